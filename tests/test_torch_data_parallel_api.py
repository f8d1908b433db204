"""dpfast.DataParallel is a torch.nn.DataParallel: isinstance, torch's attributes and state-dict keys, and torch's
overridable scatter / replicate / parallel_apply / gather methods, with dpfast's semantics (in_dims, out_dims, no
dropped samples), called directly or overridden in a subclass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT, MLP, Losses


def test_is_a_torch_data_parallel_without_cuda():
    dp = dpfast.DataParallel(MLP(), ["cpu"] * 3)
    assert isinstance(dp, nn.DataParallel)
    assert dp.device_ids == [torch.device("cpu")] * 3 and dp.output_device == torch.device("cpu")
    assert dp.src_device_obj == torch.device("cpu") and dp.dim == 0
    passthrough = dpfast.DataParallel(MLP())  # no CUDA, no device_ids: calls the module, as torch does
    assert isinstance(passthrough, nn.DataParallel) and passthrough.device_ids == []


def test_state_dict_keys_load_into_and_from_torch_data_parallel():
    torch.manual_seed(0)
    ours = dpfast.DataParallel(MLP(), ["cpu"] * 2)
    theirs = nn.DataParallel(MLP())
    assert list(ours.state_dict()) == list(theirs.state_dict()) == [f"module.{k}" for k in MLP().state_dict()]
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


class Seq(nn.Module):
    def forward(self, x, h):
        return x.sum(1), h * 2


def test_scatter_method_splits_by_in_dims_and_never_drops_a_sample():
    dp = dpfast.DataParallel(Seq(), ["cpu"] * 4, in_dims={"h": 1})
    x, h = torch.randn(10, 3), torch.randn(2, 10, 5)
    args, kwargs = dp.scatter((x,), {"h": h}, dp.device_ids)
    assert len(args) == len(kwargs) == 4
    assert [a[0].shape[0] for a in args] == [3, 3, 2, 2]
    assert [k["h"].shape for k in kwargs] == [(2, 3, 5), (2, 3, 5), (2, 2, 5), (2, 2, 5)]
    torch.testing.assert_close(torch.cat([a[0] for a in args]), x)


def test_replicate_parallel_apply_gather_compose_like_torch():
    torch.manual_seed(0)
    m = Losses().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 3, out_dims=("mean", "sum", 0))
    x, y = torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)
    args, kwargs = dp.scatter((x, y), {}, dp.device_ids)
    replicas = dp.replicate(dp.module, dp.device_ids[: len(args)])
    # the module itself first, then replicas of their own (sharing its parameters), as a call makes them
    assert (
        len(replicas) == 3
        and replicas[0] is m
        and all(r is not m and r.lin.weight is m.lin.weight for r in replicas[1:])
    )
    outputs = dp.parallel_apply(replicas, args, kwargs)
    loss, total, pred = dp.gather(outputs, dp.output_device)
    ref_loss, ref_total, ref_pred = m(x, y)
    torch.testing.assert_close(loss, ref_loss)  # "mean" weighted by the scatter's split [3, 2, 2]
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(pred, ref_pred)


class GatherCounts(dpfast.DataParallel):
    """A subclass overriding torch's gather hook (as users of torch.nn.DataParallel do)."""

    def gather(self, outputs, output_device):
        self.gathered = len(outputs)
        return super().gather(outputs, output_device)


class ScatterTags(dpfast.DataParallel):
    def scatter(self, inputs, kwargs, device_ids):
        args, kw = super().scatter(inputs, kwargs, device_ids)
        return args, tuple(dict(k, scale=float(i + 1)) for i, k in enumerate(kw))


class Scaled(nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


def test_overridden_methods_are_called_by_forward():
    x = torch.randn(6, 2)
    dp = GatherCounts(MLP(f_in=2), ["cpu"] * 3)
    out = dp(x)
    assert dp.gathered == 3 and out.shape == (6, 3)
    torch.testing.assert_close(out, dp.module(x))
    tagged = ScatterTags(Scaled(), ["cpu"] * 3)(x)
    torch.testing.assert_close(tagged, torch.cat([x[:2] * 1, x[2:4] * 2, x[4:] * 3]))


def test_scatter_method_errors_name_the_argument():
    dp = dpfast.DataParallel(Seq(), ["cpu"] * 2)
    with pytest.raises(dpfast.ScatterError, match=r"suggested fix: DataParallel\(\.\.\., in_dims=\{'h': 1\}\)"):
        dp.scatter((torch.randn(10, 3), torch.randn(2, 10, 5)), {}, dp.device_ids)
