"""Nested tensors: a jagged (``layout=torch.jagged``) nested tensor is split along its batch axis 0 and gathered back
along it; anything else nested is refused before anything is copied or run, by plan() and the call alike."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

LENGTHS = [3, 1, 4, 2, 5, 2, 3]


def _jagged(requires_grad=False):
    torch.manual_seed(0)
    parts = [torch.randn(n, 4, dtype=DT, requires_grad=requires_grad) for n in LENGTHS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parts, torch.nested.as_nested_tensor(parts, layout=torch.jagged)


class Pooled(nn.Module):
    """Per-sample sums of a jagged batch (B, j, 4) -> (B, 3), and the batch doubled (still jagged)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(DT)
        self.calls = 0

    def forward(self, nt):
        self.calls += 1
        pooled = torch.stack([t.sum(0) for t in nt.unbind()])
        return self.lin(pooled), nt * 2


def _torch_differentiates_jagged_unbind() -> bool:
    """torch 2.4's backward of unbind() on a jagged nested tensor fails even without dpfast (fixed by 2.14)."""
    parts, nt = _jagged(requires_grad=True)
    try:
        torch.stack([t.sum(0) for t in nt.unbind()]).sum().backward()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(
    not _torch_differentiates_jagged_unbind(), reason=f"torch {torch.__version__} cannot differentiate jagged unbind()"
)
def test_jagged_batch_is_split_along_its_batch_axis_and_gathered_back():
    parts, nt = _jagged(requires_grad=True)
    m = Pooled()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    assert "B = 7 split [3, 2, 2]" in str(dp.plan(nt))
    logits, doubled = dp(nt)  # was NotImplementedError: dpfast.scatter.default
    ref_parts, ref_nt = _jagged(requires_grad=True)
    ref_logits, ref_doubled = m(ref_nt)
    torch.testing.assert_close(logits, ref_logits)
    assert doubled.is_nested and doubled.layout == torch.jagged
    assert [t.shape[0] for t in doubled.unbind()] == LENGTHS
    for a, b in zip(doubled.unbind(), ref_doubled.unbind()):
        assert torch.equal(a, b)
    w = torch.arange(21, dtype=DT).reshape(7, 3)
    ((logits * w).sum() + doubled.values().sum()).backward()
    ((ref_logits * w).sum() + ref_doubled.values().sum()).backward()
    for a, b in zip(parts, ref_parts):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    "make, in_dims, match",
    [
        (
            lambda: torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)]),
            None,
            r"`nt` is a nested tensor with layout torch.strided; dpfast splits nested tensors with layout=torch.jagged",
        ),
        (lambda: _jagged()[1], 2, r"`nt` is a jagged nested tensor, which dpfast splits along its batch axis 0 only"),
    ],
)
def test_other_nested_tensors_are_refused_before_anything_runs(make, in_dims, match):
    m = Pooled()
    dp = dpfast.DataParallel(m, ["cpu"] * 2, in_dims=in_dims)
    nt = make()
    with pytest.raises(ValueError, match=match):
        dp.plan(nt)
    with pytest.raises(ValueError, match=match):
        dp(nt)
    assert m.calls == 0


def test_shard_batch_cuts_a_jagged_batch_as_data_parallel_does():
    from dpfast.distributed import shard_batch

    _, nt = _jagged()
    parts = [shard_batch(nt, r, 3) for r in range(3)]
    assert [p.size(0) for p in parts] == [3, 2, 2]
    for a, b in zip([t for p in parts for t in p.unbind()], nt.unbind()):
        assert torch.equal(a, b)
