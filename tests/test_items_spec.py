"""The ``"items"`` spec leaf: a sequence of ``B`` per-sample items (tensors of different sizes, dicts), split into
contiguous sub-sequences of the same type on the way in and concatenated in order on the way out."""

from __future__ import annotations

import copy
import typing

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


class Pool(nn.Module):
    """``seqs``: B tensors (T_i, 4) of different lengths; ``feats``: (B, 4). Returns logits (B, 3)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(DT)
        self.seen: list = []

    def forward(self, feats, seqs):
        self.seen.append(seqs)
        pooled = torch.stack([s.mean(0) for s in seqs])
        return self.lin(pooled + feats)


def _seqs(lengths, requires_grad=False):
    torch.manual_seed(0)
    return [torch.randn(n, 4, dtype=DT, requires_grad=requires_grad) for n in lengths]


LENGTHS = [5, 3, 9, 1, 4, 4, 7, 2]


def test_scatter_error_suggests_items_for_a_list_of_tensors_of_different_sizes():
    m = Pool()
    feats = torch.randn(8, 4, dtype=DT)
    with pytest.raises(
        dpfast.ScatterError, match=r"suggested fix: DataParallel\(\.\.\., in_dims=\{'seqs': 'items'\}\)"
    ):
        dpfast.DataParallel(m, ["cpu"] * 4)(feats, _seqs(LENGTHS))
    # following the suggestion gives the plain module's (8, 3), not one copy per replica (32, 3)
    out = dpfast.DataParallel(m, ["cpu"] * 4, in_dims={"seqs": "items"})(feats, _seqs(LENGTHS))
    assert out.shape == (8, 3)
    torch.testing.assert_close(out, m(feats, _seqs(LENGTHS)))


def test_items_in_are_contiguous_sub_sequences_of_the_same_type_with_gradients():
    torch.manual_seed(1)
    m = Pool()
    ref = copy.deepcopy(m)
    feats = torch.randn(8, 4, dtype=DT)
    s1, s2 = _seqs(LENGTHS, True), _seqs(LENGTHS, True)
    dp = dpfast.DataParallel(m, ["cpu"] * 3, in_dims={"seqs": "items"})
    out = dp(feats, tuple(s1))
    expected = ref(feats, tuple(s2))
    torch.testing.assert_close(out, expected)
    got = m.seen[-3:]
    assert all(type(g) is tuple for g in got)
    index = {id(s): i for i, s in enumerate(s1)}  # on the source device the items are the caller's own
    assert sorted([index[id(s)] for s in g] for g in got) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    (out * torch.arange(24, dtype=DT).reshape(8, 3)).sum().backward()
    (expected * torch.arange(24, dtype=DT).reshape(8, 3)).sum().backward()
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)


class PerSample(nn.Module):
    """Returns one dict per sample, as torchvision detection models do in eval."""

    def forward(self, seqs):
        return [{"total": s.sum(0), "length": s.shape[0]} for s in seqs]


def test_items_out_are_concatenated_in_order():
    seqs = _seqs(LENGTHS)
    dp = dpfast.DataParallel(PerSample(), ["cpu"] * 4, in_dims="items", out_dims="items")
    out = dp(seqs)
    expected = PerSample()(seqs)
    assert type(out) is list and len(out) == 8
    for a, b in zip(out, expected):
        assert list(a) == ["total", "length"] and a["length"] == b["length"]
        torch.testing.assert_close(a["total"], b["total"])


def test_plan_shows_items_per_replica():
    dp = dpfast.DataParallel(Pool(), ["cpu"] * 3, in_dims={"seqs": "items"})
    text = str(dp.plan(torch.randn(8, 4, dtype=DT), _seqs(LENGTHS)))
    assert "B = 8 split [3, 3, 2]" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("seqs"))
    assert "list[8]" in row and "'items'" in row and "list[3]" in row and "list[2]" in row


class Point(typing.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@pytest.mark.parametrize(
    "value, exc, match",
    [
        (torch.randn(8, 4), TypeError, r"in_dims for `seqs` is 'items', but `seqs` is a Tensor of shape \(8, 4\)"),
        (Point(torch.randn(8), torch.randn(8)), TypeError, r"`seqs` is a Point with fields"),
        ({"a": torch.randn(8)}, TypeError, r"'items' is for a list or tuple of per-sample items"),
    ],
)
def test_items_on_a_value_that_is_not_a_sequence(value, exc, match):
    dp = dpfast.DataParallel(Pool(), ["cpu"] * 2, in_dims={"seqs": "items"})
    with pytest.raises(exc, match=match):
        dp.plan(torch.randn(8, 4, dtype=DT), value)


def test_items_count_is_the_batch_size():
    dp = dpfast.DataParallel(Pool(), ["cpu"] * 2, in_dims={"seqs": "items"})
    with pytest.raises(dpfast.ScatterError, match=r"seqs\s+list\[5\]\s+'items'\s+items\s+5\s+<- expected 8"):
        dp(torch.randn(8, 4, dtype=DT), _seqs([1, 2, 3, 4, 5]))


def test_items_out_on_a_non_sequence_names_the_output():
    dp = dpfast.DataParallel(Pool(), ["cpu"] * 2, in_dims={"seqs": "items"}, out_dims="items")
    with pytest.raises(TypeError, match=r"out_dims for `output` is 'items', but `output` is a Tensor"):
        dp(torch.randn(8, 4, dtype=DT), _seqs(LENGTHS))


def test_shard_batch_cuts_items_as_data_parallel_does():
    from dpfast.distributed import shard_batch

    seqs = _seqs(LENGTHS)
    parts = [shard_batch({"seqs": seqs, "y": torch.arange(8)}, r, 3, in_dims={"seqs": "items"}) for r in range(3)]
    assert [len(p["seqs"]) for p in parts] == [3, 3, 2]
    assert all(a is b for a, b in zip([s for p in parts for s in p["seqs"]], seqs))
    assert torch.equal(torch.cat([p["y"] for p in parts]), torch.arange(8))


def test_ddp_gather_outputs_says_it_cannot_all_gather_items():
    from dpfast.distributed.output_layout import sort_outputs

    with pytest.raises(TypeError, match=r"`output` has out_dims 'items', which gather_outputs cannot all-gather"):
        sort_outputs(_seqs([1, 2]), "items", 0, True)
