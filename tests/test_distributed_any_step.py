"""Ranks that disagree raise DistributedBatchError on every rank, promptly, on any step: the first, and after good
steps, with and without gather_outputs, with grad and under no_grad, with the global batch and per-rank inputs.

After the first step the ranks' check rides in a collective the step runs anyway (the output exchange, DDP's first
gradient bucket, or a small all-gather under no_grad). A rank whose module raised on its share (here: the same batch
in another dtype) must still reach that collective, or the others wait in it until the timeout: it joins the check
with a failed status, and every rank raises. When every rank's module raised, each raises its own error, as it would
without dpfast.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpfast

from ddp_harness import GroupRuns, expect_batch_error
from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")

WITHIN_S = 5.0
GOOD_STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, mask=None):
        out = self.lin(x)
        return out if mask is None else out * mask


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net().to(DT)


def _batch(b: int = 6) -> torch.Tensor:
    return torch.randn(b, 4, dtype=DT, generator=torch.Generator().manual_seed(b))


def _step(ddp, *args, grad: bool = True, **kwargs) -> None:
    if grad:
        ddp(*args, **kwargs).sum().backward()
    else:
        with torch.no_grad():
            ddp(*args, **kwargs)


def _last() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _good_steps(ddp, n: int, grad: bool) -> None:
    for _ in range(n):
        _step(ddp, _batch(), grad=grad)


def _other_dtype(mode: str, gather: bool, grad: bool, good: int):
    """The last rank is given its batch in float32 (the module is float64: its forward raises there)."""

    def run():
        ddp = dpfast.DistributedDataParallel(_net(), inputs=mode, gather_outputs=gather)
        _good_steps(ddp, good, grad)
        x = _batch()
        x = x.float() if _last() else x
        expect_batch_error(lambda: _step(ddp, x, grad=grad), ["float32"], within_s=WITHIN_S)
        _step(ddp, _batch(), grad=grad)  # the group is usable again: every rank raised at the same step

    return run


def _other_batch_size(gather: bool, grad: bool):
    """Global batch: the last rank is given a batch of another size, which its module runs without complaint."""

    def run():
        ddp = dpfast.DistributedDataParallel(_net(), gather_outputs=gather)
        _good_steps(ddp, GOOD_STEPS, grad)
        x = _batch(7) if _last() else _batch(6)
        expect_batch_error(lambda: _step(ddp, x, grad=grad), ["B differs"], within_s=WITHIN_S)

    return run


def _other_structure(mode: str, gather: bool, grad: bool):
    """The last rank passes one more argument than the others (its module runs it)."""

    def run():
        ddp = dpfast.DistributedDataParallel(_net(), inputs=mode, gather_outputs=gather)
        _good_steps(ddp, GOOD_STEPS, grad)
        x = _batch()
        extra = {"mask": torch.ones(6, 3, dtype=DT)} if _last() else {}
        expect_batch_error(lambda: _step(ddp, x, grad=grad, **extra), ["mask"], within_s=WITHIN_S)

    return run


class _Casting(Net):
    def forward(self, x, mask=None):
        return super().forward(x.to(self.lin.weight.dtype), mask)


def _other_dtype_a_module_accepts(mode: str):
    """The last rank's batch in float32, which its module casts and runs: the records alone must tell."""

    def run():
        torch.manual_seed(0)
        ddp = dpfast.DistributedDataParallel(_Casting().to(DT), inputs=mode)
        _good_steps(ddp, GOOD_STEPS, True)
        x = _batch()
        x = x.float() if _last() else x
        expect_batch_error(lambda: _step(ddp, x), ["float32"], within_s=WITHIN_S)

    return run


class _RaisesOnLast(Net):
    def __init__(self, after: int):
        super().__init__()
        self.calls, self.after = 0, after

    def forward(self, x, mask=None):
        self.calls += 1
        if self.calls > self.after and dist.get_rank() == dist.get_world_size() - 1:
            raise RuntimeError("the module failed on this rank's data")
        return super().forward(x, mask)


def _module_raises_on_one_rank(gather: bool, grad: bool):
    """The same batch everywhere, but the last rank's module raises (a data-dependent failure)."""

    def run():
        torch.manual_seed(0)
        ddp = dpfast.DistributedDataParallel(_RaisesOnLast(GOOD_STEPS).to(DT), gather_outputs=gather)
        _good_steps(ddp, GOOD_STEPS, grad)
        msg = expect_batch_error(lambda: _step(ddp, _batch(), grad=grad), within_s=WITHIN_S)
        assert "the module failed on this rank's data" in msg, msg

    return run


class _AlwaysRaises(Net):
    def forward(self, x, mask=None):
        if x.shape[0] > 2:
            raise RuntimeError("the same bug on every rank")
        return super().forward(x, mask)


def _module_raises_everywhere(gather: bool, grad: bool):
    """Every rank's module raises: each rank gets its module's own error, as without dpfast."""

    def run():
        torch.manual_seed(0)
        ddp = dpfast.DistributedDataParallel(_AlwaysRaises().to(DT), gather_outputs=gather, inputs="per_rank")
        _step(ddp, _batch(2), grad=grad)
        with pytest.raises(RuntimeError, match="the same bug on every rank") as info:
            _step(ddp, _batch(6), grad=grad)
        assert not isinstance(info.value, dpfast.DistributedBatchError)
        _step(ddp, _batch(2), grad=grad)

    return run


def _scenarios(world: int) -> dict:
    out = {}
    for mode, gather, grad, good in itertools.product(("global", "per_rank"), (False, True), (True, False), (0, 3)):
        name = f"dtype-{mode}-{'gather' if gather else 'local'}-{'grad' if grad else 'nograd'}-after{good}"
        out[name] = _other_dtype(mode, gather, grad, good)
    for gather, grad in itertools.product((False, True), (True, False)):
        tail = f"{'gather' if gather else 'local'}-{'grad' if grad else 'nograd'}"
        out[f"batch-size-{tail}"] = _other_batch_size(gather, grad)
        out[f"module-raises-on-one-{tail}"] = _module_raises_on_one_rank(gather, grad)
        out[f"module-raises-everywhere-{tail}"] = _module_raises_everywhere(gather, grad)
        for mode in ("global", "per_rank"):
            out[f"structure-{mode}-{tail}"] = _other_structure(mode, gather, grad)
    for mode in ("global", "per_rank"):
        out[f"dtype-cast-{mode}"] = _other_dtype_a_module_accepts(mode)
    return out


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
