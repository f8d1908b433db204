"""dpfast.DistributedDataParallel with real packages' models on 2 gloo ranks (CPU processes), against the plain
model on the whole batch in one process: a tiny Hugging Face BERT (ModelOutput with its loss, logits and hidden
states; padded attention masks; the global batch, and each rank's own rows) and a torchvision ResNet-18 in
channels_last with dpfast's SyncBatchNorm (training-mode statistics over the ranks' uneven shares) returning its
feature maps through torchvision's feature extractor; and the BERT under FSDP2 as HF's recipe shards it (torch's
``fully_shard`` per layer, ``dpfast.distributed.fully_shard`` on the root). Nothing is downloaded; float64, no
dropout.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

import dpfast  # noqa: E402
from dpfast.distributed import shard_batch  # noqa: E402
from dpfast.run.rendezvous import solo_context  # noqa: E402

from ddp_harness import GroupRuns, assert_tree_close, grads  # noqa: E402
from dp_testing import DT  # noqa: E402

V, B, T = 50, 5, 6  # B = 5 is uneven over 2 ranks (3 + 2)


def _bert() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).to(DT)


def _bert_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(B, T, dtype=torch.long)
    for i in range(B):
        mask[i, T - (i % 3) :] = 0  # padding, different per row
    ids = torch.randint(1, V, (B, T), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(B) % 3, "output_hidden_states": True}


def _assert_same_grads(ddp_module: torch.nn.Module, ref: torch.nn.Module) -> None:
    got, want = grads(ddp_module), grads(ref)
    for name in want:
        assert got[name] is not None, f"{name}: no gradient"
        torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"grad of {name}: {m}")


def _bert_equals_the_full_batch(inputs: str) -> None:
    """The gathered ModelOutput (the loss a share-weighted mean, logits and every hidden state concatenated in
    rank order) and the parameters' gradients of a loss on it are the whole batch's; so are the outputs of the
    calls after it, which change the outputs' structure and the inputs' shapes."""
    module = _bert()
    ref = copy.deepcopy(module)
    batch = _bert_batch()
    ddp = dpfast.DistributedDataParallel(module, inputs=inputs, gather_outputs=True, out_dims={"loss": "mean"})
    with solo_context():
        expected = ref(**batch)
    given = batch if inputs == "global" else shard_batch(batch, in_dims={"output_hidden_states": None})
    if inputs == "per_rank":
        assert given["input_ids"].shape[0] == (3 if dist.get_rank() == 0 else 2)
    out = ddp(**given)
    assert type(out) is type(expected)
    assert list(out.keys()) == ["loss", "logits", "hidden_states"] and out.attentions is None
    assert_tree_close(out.to_tuple(), expected.to_tuple(), "gathered outputs")
    expected.loss.backward()
    out.loss.backward()
    _assert_same_grads(ddp.module, ref)
    # the next calls change what the kept call and the kept output layout were made from: no hidden states, then
    # shorter sequences (their values are the whole batch's again, not a stale cut or layout's)
    for change in ({"output_hidden_states": False}, {"input_ids": batch["input_ids"][:, :4]}):
        changed = dict(batch, **change)
        changed["attention_mask"] = changed["attention_mask"][:, : changed["input_ids"].shape[1]]
        with torch.no_grad():
            with solo_context():
                expected = ref(**changed)
            given = changed if inputs == "global" else shard_batch(changed, in_dims={"output_hidden_states": None})
            assert_tree_close(ddp(**given).to_tuple(), expected.to_tuple(), f"outputs after {sorted(change)}")


def _bert_under_fsdp2(inputs: str) -> None:
    """The HF recipe for FSDP2 (torch's ``fully_shard`` on each ``BertLayer``, then dpfast's on the root) with
    gathered outputs: two SGD steps whose ModelOutput, gradients (``full_tensor()``) and parameters are the whole
    batch's in one process, then a call that changes the outputs' structure."""
    from torch.distributed import fsdp
    from torch.distributed.device_mesh import init_device_mesh

    module, ref = _bert(), _bert()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in module.bert.encoder.layer:
        fsdp.fully_shard(layer, mesh=mesh)
    net = dpfast.distributed.fully_shard(
        module, mesh=mesh, inputs=inputs, gather_outputs=True, out_dims={"loss": "mean"}
    )
    batch = _bert_batch()
    given = batch if inputs == "global" else shard_batch(batch, in_dims={"output_hidden_states": None})
    opt, opt_ref = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        with solo_context():
            expected = ref(**batch)
        out = net(**given)
        assert type(out) is type(expected) and list(out.keys()) == ["loss", "logits", "hidden_states"]
        assert_tree_close(out.to_tuple(), expected.to_tuple(), f"step {step} gathered outputs")
        expected.loss.backward()
        out.loss.backward()
        for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            what = f"step {step} grad of {name}"
            torch.testing.assert_close(full, q.grad, msg=lambda m, what=what: f"{what}: {m}")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        torch.testing.assert_close(full, q.detach(), msg=lambda m, name=name: f"trained {name}: {m}")
    with torch.no_grad():
        changed = dict(batch, output_hidden_states=False)
        with solo_context():
            expected = ref(**changed)
        given = changed if inputs == "global" else shard_batch(changed, in_dims={"output_hidden_states": None})
        assert_tree_close(net(**given).to_tuple(), expected.to_tuple(), "outputs without hidden states")


def _resnet_sync_batchnorm_channels_last() -> None:
    """Two training steps of a channels_last ResNet-18 whose BatchNorms are dpfast's SyncBatchNorm, returning its
    layer2 feature maps beside the logits (torchvision's feature extractor): the gathered maps (channels_last) and
    logits, the gradients and the running statistics are those of torch's BatchNorm over the whole batch."""
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    net = create_feature_extractor(torchvision.models.resnet18(num_classes=3), {"layer2": "maps", "fc": "logits"})
    module = net.to(DT).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(module)
    ddp = dpfast.DistributedDataParallel(dpfast.nn.convert_sync_batchnorm(module), gather_outputs=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, 3, 32, 32, dtype=DT, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.arange(B) % 3

    def loss(out):
        return torch.nn.functional.cross_entropy(out["logits"], y) + out["maps"].pow(2).mean()

    for step in range(2):
        for model in (ref, ddp):
            model.zero_grad()
        with solo_context():
            expected = ref(x)
        out = ddp(x)
        assert_tree_close(out, expected, f"step {step} outputs")
        assert out["maps"].is_contiguous(memory_format=torch.channels_last) and not out["maps"].is_contiguous()
        loss(expected).backward()
        loss(out).backward()
        _assert_same_grads(ddp.module, ref)
        buffers = list(ddp.module.buffers())
        assert len(buffers) == len(list(ref.buffers())) > 0
        for (name, a), b in zip(ref.named_buffers(), buffers):
            torch.testing.assert_close(b, a, msg=lambda m, name=name, step=step: f"step {step} buffer {name}: {m}")
        with torch.no_grad():  # the same step taken on both, so the second compares trained weights
            for p, q in zip(ref.parameters(), ddp.module.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad


def _scenarios(world):
    out = {
        "bert_global_batch": lambda: _bert_equals_the_full_batch("global"),
        "bert_per_rank_rows": lambda: _bert_equals_the_full_batch("per_rank"),
        "resnet18_features_sync_batchnorm_channels_last": _resnet_sync_batchnorm_channels_last,
    }
    if hasattr(torch.distributed.fsdp, "fully_shard"):  # FSDP2, from torch 2.6
        out["bert_fsdp2_per_layer_global_batch"] = lambda: _bert_under_fsdp2("global")
        out["bert_fsdp2_per_layer_per_rank_rows"] = lambda: _bert_under_fsdp2("per_rank")
    return out


RUNS = GroupRuns(_scenarios, worlds=(2,))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
