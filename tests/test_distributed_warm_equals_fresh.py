"""A warmed DistributedDataParallel equals a fresh one, on 2 and 3 gloo ranks, in both input modes: a seeded random
sequence of calls (batch sizes, dtypes, an RNN-like state split along axis 1, a mask passed whole, keywords coming
and going) through one wrapper, each call compared with a fresh wrapper built for it (a copy of the same module):
the same gathered outputs bit for bit, and the same gradients (to the last bits gloo's ring sum of three ranks
leaves to the buckets' layout). (The same without a process group, under
hypothesis: test_warm_equals_fresh.py.)"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import dpfast

from ddp_harness import GroupRuns
from dp_testing import DT, assert_bitexact

pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, state=None, *, mask=None):
        y = torch.tanh(self.lin(x.to(self.lin.weight.dtype)))
        return {"y": y, "state": None if state is None else state * y.sum(), "mask": mask}


OPTIONS = dict(in_dims={"state": 1, "mask": None}, out_dims={"state": 1, "mask": None}, gather_outputs=True)


def _calls(seed: int, n: int, per_rank: bool, rank: int) -> list[tuple[tuple, dict]]:
    """The same structure on every rank; per-rank inputs: each rank's own rows (their counts may differ)."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        rows = r.randrange(1, 6)
        rows = rows + (rank % 2 if per_rank else 0)
        dtype = r.choice([torch.float64, torch.float32])
        g = torch.Generator().manual_seed(r.randrange(10**6) + (rank if per_rank else 0))
        args: tuple = (torch.randn(rows, 4, generator=g).to(dtype),)
        if r.random() < 0.5:
            args += (torch.randn(2, rows, 3, dtype=DT, generator=g),)
        kwargs = {"mask": torch.ones(2, 2, dtype=DT)} if r.random() < 0.5 else {}
        for _ in range(r.randrange(1, 3)):  # a call again, as a training loop repeats one
            out.append((args, kwargs))
    return out


def _loss(out: dict) -> torch.Tensor:
    loss = out["y"].pow(2).sum()
    return loss if out["state"] is None else loss + out["state"].sum()


def _warm_equals_fresh(inputs: str):
    def run():
        rank = torch.distributed.get_rank()
        torch.manual_seed(0)
        module = Net().to(DT)
        warm = dpfast.DistributedDataParallel(copy.deepcopy(module), inputs=inputs, **OPTIONS)
        for step, (args, kwargs) in enumerate(_calls(7, 10, inputs == "per_rank", rank)):
            fresh = dpfast.DistributedDataParallel(copy.deepcopy(module), inputs=inputs, **OPTIONS)
            results = []
            for ddp in (warm, fresh):
                ddp.zero_grad()
                out = ddp(*args, **kwargs)
                _loss(out).backward()
                results.append((out, [p.grad.clone() for p in ddp.parameters()]))
            (out_w, grads_w), (out_f, grads_f) = results
            assert list(out_w) == list(out_f), step
            for key in out_w:
                assert (out_w[key] is None) == (out_f[key] is None), (step, key)
                if out_w[key] is not None:
                    assert_bitexact(out_w[key], out_f[key])
            for a, b in zip(grads_w, grads_f):  # (gloo's ring sums in an order that depends on the buckets'
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)  # layout, which DDP rebuilds after step 1)
        assert warm._specs.programs.compiled < 10  # (calls of a key seen before ran its program)

    return run


def _scenarios(world: int) -> dict:
    return {f"{inputs}": _warm_equals_fresh(inputs) for inputs in ("global", "per_rank")}


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
