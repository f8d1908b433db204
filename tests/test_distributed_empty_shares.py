"""Ranks without rows (B < world size) whose module refuses an empty batch (issue 27, item 1).

Before, such a rank ran one real sample (a "ghost") in its place: counted in SyncBatchNorm's cross-rank statistics
when the refusal came before it (outputs, gradients and running statistics silently wrong), a hang until the
timeout when it came after it (the ranks in different collectives), and with local BatchNorm the ghost itself was
refused (that rank raised, the others waited). Now the result equals the full batch, or every rank raises the same
clear error at once; a rank without rows never changes another rank's numbers, nor its own buffers.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

import dpfast
from dpfast.run.rendezvous import solo_context

from ddp_harness import GroupRuns, expect_batch_error
from dp_testing import DT


class ViewThenSync(nn.Module):
    """``x.view(B, -1)`` before a SyncBatchNorm: an empty batch is refused before the collective."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = dpfast.nn.SyncBatchNorm(3)

    def forward(self, x):  # (B, 2, 2)
        return torch.tanh(self.bn(self.lin(x.view(x.shape[0], -1))))


class SyncThenView(nn.Module):
    """A SyncBatchNorm, then ``h.view(B, -1)``: an empty batch is refused after the collective."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = dpfast.nn.SyncBatchNorm(3)
        self.out = nn.Linear(3, 2)

    def forward(self, x):  # (B, 4)
        h = torch.tanh(self.bn(self.lin(x)))
        return self.out(h.view(h.shape[0], -1))


class ViewThenLocalBatchNorm(nn.Module):
    """``x.view(B, -1)`` refuses an empty batch, and plain BatchNorm in training one sample (no collective)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):  # (B, 2, 2)
        return self.bn(self.lin(x.view(x.shape[0], -1)))


class NeedsTwo(nn.Module):
    """Refuses fewer than two rows (so the one-sample stand-in is refused too)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        if x.shape[0] < 2:
            raise ValueError(f"NeedsTwo got {x.shape[0]} rows")
        return self.lin(x)


class CountsRows(nn.Module):
    """Refuses an empty batch; counts the rows it sees in a buffer and draws random numbers (dropout)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros((), dtype=DT))

    def forward(self, x):
        if x.shape[0] == 0:
            raise RuntimeError("CountsRows needs rows")
        self.seen += x.shape[0]
        return self.lin(x) + 0 * torch.rand(())


def _x(b, *shape, seed=0):
    return torch.randn(b, *shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _ghost_counted(gather):
    """3 ranks, B = 2: rank 2 has no rows. Its stand-in sample would be counted in SyncBatchNorm's statistics
    (the outputs were off by 0.16, the gradients by 1.4): every rank raises instead, in forward with
    gather_outputs, from backward() without."""
    torch.manual_seed(0)
    ddp = dpfast.DistributedDataParallel(ViewThenSync().to(DT), gather_outputs=gather)
    x = _x(2, 2, 2)
    msg = expect_batch_error(lambda: ddp(x).sum().backward(), contains=("rank 2 has no rows", "reached a collective"))
    assert "x.reshape(len(x), -1)" in msg, msg
    _still_usable()


def _refused_after_the_collective():
    """3 ranks, B = 2, the refusal after SyncBatchNorm: the ranks hung in different collectives. The stand-in
    now gets the collectives' results instead of sending again, so the step equals BatchNorm on the full batch:
    outputs, gradients, running statistics."""
    torch.manual_seed(0)
    plain = SyncThenView().to(DT)
    ddp = dpfast.DistributedDataParallel(copy.deepcopy(plain), gather_outputs=True)
    for step in range(2):
        x = _x(2, 4, seed=step)
        out = ddp(x)
        with solo_context():
            ref = plain(x)
        torch.testing.assert_close(out, ref)
        ddp.zero_grad()
        plain.zero_grad()
        (out * out.detach().cos()).sum().backward()
        (ref * ref.detach().cos()).sum().backward()
        for (name, p), (_, q) in zip(ddp.module.named_parameters(), plain.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        for (name, b), (_, c) in zip(ddp.module.named_buffers(), plain.named_buffers()):
            torch.testing.assert_close(b, c, msg=lambda m, name=name: f"buffer {name}: {m}")


def _no_rows_for_the_last_rank(world, *shape):
    """chunk_sizes with a 0 for the last rank, and two rows for each of the others."""
    return {"chunk_sizes": [1] * (world - 1) + [0]}, _x(2 * (world - 1), *shape)


def _refused_twice(module_cls, gather):
    """The last rank has no rows and its module refuses both an empty batch and one sample (local BatchNorm in
    training refuses both): that rank raised and the others waited. Now every rank raises at once."""
    torch.manual_seed(0)
    world = dist.get_world_size()
    weights, x = _no_rows_for_the_last_rank(world, *(2, 2) if module_cls is ViewThenLocalBatchNorm else (4,))
    ddp = dpfast.DistributedDataParallel(module_cls().to(DT), gather_outputs=gather, **weights)
    expect_batch_error(
        lambda: ddp(x).sum().backward(), contains=(f"rank {world - 1} has no rows", "refused an empty batch")
    )
    _still_usable()


def _refused_under_no_grad():
    """Under no_grad no gradient all-reduce follows, so the check is one small all-gather: every rank raises."""
    world = dist.get_world_size()
    weights, x = _no_rows_for_the_last_rank(world, 4)
    ddp = dpfast.DistributedDataParallel(NeedsTwo().to(DT), **weights)
    with torch.no_grad():
        expect_batch_error(lambda: ddp(x), contains=(f"rank {world - 1} has no rows",))
    _still_usable()


def _ghost_leaves_no_trace():
    """The stand-in sample changes neither this rank's buffers nor its random-number state (before, the rank
    without rows counted a row it does not have)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ddp = dpfast.DistributedDataParallel(CountsRows().to(DT), gather_outputs=True, broadcast_buffers=False)
    x = _x(world - 1, 4)
    rng = torch.get_rng_state()
    out = ddp(x)
    assert out.shape == (world - 1, 2)
    out.sum().backward()
    if rank == world - 1:
        assert float(ddp.module.seen) == 0.0
        assert torch.equal(torch.get_rng_state(), rng)
    else:
        assert float(ddp.module.seen) == 1.0
    torch.testing.assert_close(ddp.module.lin.bias.grad, torch.full((2,), float(world - 1), dtype=DT))


def _still_usable():
    ddp = dpfast.DistributedDataParallel(nn.Linear(4, 2).to(DT), gather_outputs=True)
    ddp(_x(2 * dist.get_world_size(), 4)).sum().backward()


def _scenarios(world):
    out = {
        "refused_twice_local_batchnorm_gather": functools.partial(_refused_twice, ViewThenLocalBatchNorm, True),
        "refused_twice_local_batchnorm": functools.partial(_refused_twice, ViewThenLocalBatchNorm, False),
        "refused_twice_gather": functools.partial(_refused_twice, NeedsTwo, True),
        "refused_twice": functools.partial(_refused_twice, NeedsTwo, False),
        "refused_under_no_grad": _refused_under_no_grad,
        "ghost_leaves_no_trace": _ghost_leaves_no_trace,
    }
    if world == 3:  # SyncBatchNorm needs more than one value per channel over the whole batch: B = 2
        out["ghost_counted_gather"] = functools.partial(_ghost_counted, True)
        out["ghost_counted"] = functools.partial(_ghost_counted, False)
        out["refused_after_the_collective"] = _refused_after_the_collective
    return out


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
