"""torchvision detection under dpfast.DataParallel on the CPU rehearsal: ``images`` (a list of tensors of different
sizes), ``targets`` (a list of dicts) and the eval output (one dict per image) are sequences of per-sample items, so
they take the ``"items"`` spec. A small Faster R-CNN (``weights=None``: nothing downloaded) in float64."""

from __future__ import annotations

import copy

import pytest
import torch

torchvision = pytest.importorskip("torchvision")
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn  # noqa: E402

import dpfast  # noqa: E402

from dp_testing import DT  # noqa: E402

SIZES = [(40, 40), (50, 50), (64, 64), (30, 30), (57, 57)]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def detector():
    # min_size == max_size == 64 and square images: every image is resized to 64 x 64, so there is no padding and an
    # image's result does not depend on which other images share its batch (padding would also give many anchors
    # equal scores, whose order in topk is the kernel's choice). Huge sampler batches sample every anchor and
    # proposal: no random subset, so a train step's losses are deterministic.
    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64, box_detections_per_img=5,
        rpn_pre_nms_top_n_test=40, rpn_post_nms_top_n_test=20, rpn_pre_nms_top_n_train=40,
        rpn_post_nms_top_n_train=20, rpn_batch_size_per_image=10**6, box_batch_size_per_image=10**6,
    )  # fmt: skip
    return model.to(DT)


def _images():
    g = torch.Generator().manual_seed(1)
    return [torch.rand(3, h, w, dtype=DT, generator=g) for h, w in SIZES]


def _targets():
    return [
        {"boxes": torch.tensor([[2.0 + i, 3.0, 20.0 + 2 * i, 25.0]], dtype=DT), "labels": torch.tensor([1 + i % 2])}
        for i in range(len(SIZES))
    ]


def test_eval_returns_one_dict_per_image_in_caller_order():
    model = detector().eval()
    dp = dpfast.DataParallel(model, ["cpu"] * 4, in_dims={"images": "items"}, out_dims="items")
    with torch.no_grad():
        out = dp(_images())
        ref = model(_images())
    assert type(out) is list and len(out) == 5  # was 2 entries: lists gathered position by position
    for a, b in zip(out, ref):
        assert list(a) == ["boxes", "labels", "scores"] and a["boxes"].shape[0] > 0
        torch.testing.assert_close(a["boxes"], b["boxes"])
        torch.testing.assert_close(a["scores"], b["scores"])
        assert torch.equal(a["labels"], b["labels"])


def test_train_step_loss_dict_is_the_share_weighted_mean_of_the_replicas():
    model = detector().train()
    ref = copy.deepcopy(model)
    dp = dpfast.DataParallel(model, ["cpu"] * 4, in_dims={"images": "items", "targets": "items"}, out_dims="mean")
    assert dp.plan(_images(), _targets()).sizes == [2, 1, 1, 1]
    losses = dp(_images(), _targets())
    assert sorted(losses) == ["loss_box_reg", "loss_classifier", "loss_objectness", "loss_rpn_box_reg"]
    images, targets = _images(), _targets()
    chunks = [(0, 2), (2, 3), (3, 4), (4, 5)]
    per_chunk = [ref(images[a:b], targets[a:b]) for a, b in chunks]
    expected = {k: sum(c[k] * (b - a) / 5 for c, (a, b) in zip(per_chunk, chunks)) for k in losses}
    for k in losses:
        torch.testing.assert_close(losses[k], expected[k])
    sum(losses.values()).backward()
    sum(expected.values()).backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
    assert grads and all(g is not None for g, _ in grads)
    for g, h in grads:
        torch.testing.assert_close(g, h)
