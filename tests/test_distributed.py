"""dpfast.DistributedDataParallel on 2 and 3 gloo ranks (CPU processes), against the single-process full-batch run.

The scenarios run inside one spawned group per world size (tests/ddp_harness.py); the tests below read their results.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpfast
import dpfast.plan.splits
from dpfast.distributed import shard_batch, shard_dataset, shard_range
from dpfast.run.rendezvous import solo_context

from ddp_harness import (
    RRN,
    GroupRuns,
    assert_tree_close,
    expect_batch_error,
    grads,
    losses_loss,
    rrn_inputs,
    rrn_loss,
    xy,
)
from dp_testing import DT, Contrastive, Losses, NoEmpty

BATCHES = {2: (5, 1), 3: (7, 2)}  # not divisible by the world size, and smaller than it


# ---- models --------------------------------------------------------------------------------------------------------


class ByLength(nn.Module):
    """Per-sample outputs scaled by each sample's length, and a per-sample-mean loss: the costs are an input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, lengths):
        pred = self.lin(x) * lengths.unsqueeze(1)
        return pred.pow(2).mean(), pred


SORTED_LENGTHS = [9.0, 5.0, 3.0, 2.0, 1.0, 1.0, 1.0]  # sorted, as packed batches are: the count split is lopsided


def _lengthsxy():
    g = torch.Generator().manual_seed(300)
    return torch.randn(len(SORTED_LENGTHS), 4, dtype=DT, generator=g), torch.tensor(SORTED_LENGTHS, dtype=DT)


def _leaf_copies(inputs):
    """The inputs with every tensor a fresh leaf that requires grad (to compare input gradients too)."""
    return torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), inputs)


def _compare_with_full_batch(factory, inputs, loss_fn, ddp_kwargs, steps=1):
    """DDP on the global batch vs the plain module on the whole batch: gathered outputs, and the gradients of every
    parameter and every input. ``steps > 1`` feeds the gathered outputs back in (the RRN's reasoning loop)."""
    torch.manual_seed(0)
    module = factory().to(DT)
    ref = copy.deepcopy(module)
    ddp = dpfast.DistributedDataParallel(module, gather_outputs=True, **ddp_kwargs)
    in_ref, in_ddp = _leaf_copies(inputs), _leaf_copies(inputs)

    def run(net, args):
        outs = []
        for step in range(steps):
            out = net(*args)
            outs.append(out)
            if step + 1 < steps:
                args = (args[0],) + tuple(out[1:])  # (x, hidden, h) <- (x, returned hidden, returned h)
        return outs

    with solo_context():  # the reference is one process: dpfast's collectives in it must not reach the ranks
        expected = run(ref, in_ref)
    outputs = run(ddp, in_ddp)
    assert_tree_close(outputs, expected, "gathered outputs")
    sum(loss_fn(o) for o in expected).backward()
    sum(loss_fn(o) for o in outputs).backward()
    got, want = grads(ddp.module), grads(ref)
    for name in want:
        assert got[name] is not None, f"{name}: no gradient"
        torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"grad of {name}: {m}")
    assert_tree_close(
        torch.utils._pytree.tree_map(lambda t: t.grad, in_ddp),
        torch.utils._pytree.tree_map(lambda t: t.grad, in_ref),
        "input gradients",
    )
    return ddp


# ---- scenarios (run inside every rank) --------------------------------------------------------------------------


def _scenarios(world):
    out = {}
    for b in BATCHES[world]:
        out[f"rrn_B{b}"] = functools.partial(
            _compare_with_full_batch,
            RRN,
            rrn_inputs(b),
            rrn_loss,
            dict(in_dims={"h": 1}, out_dims=(0, 0, 1)),
            steps=2,
        )
        out[f"losses_B{b}"] = functools.partial(
            _compare_with_full_batch, Losses, xy(b), losses_loss, dict(out_dims=("mean", "sum", 0))
        )
        out[f"local_loss_scale_B{b}"] = functools.partial(_local_loss_scale, b)
    out["ghost_when_module_refuses_empty"] = functools.partial(
        _compare_with_full_batch, NoEmpty, xy(world - 1), losses_loss, dict(out_dims=("mean", "sum", 0))
    )
    weights = [1] + [0] + [2] * (world - 2)  # rank 1 gets no rows at all
    out["chunk_sizes_zero_weight"] = functools.partial(
        _compare_with_full_batch, Losses, xy(5), losses_loss, dict(out_dims=("mean", "sum", 0), chunk_sizes=weights)
    )
    out["collectives_contrastive"] = functools.partial(
        _compare_with_full_batch, Contrastive, _views(7), lambda loss: loss, dict(out_dims="sum")
    )
    out["sync_batchnorm"] = functools.partial(_sync_batchnorm_vs_full_batch, 7)
    out["sync_batchnorm_rank_without_rows"] = functools.partial(_sync_batchnorm_vs_full_batch, world + 1)
    out["buffers_from_the_first_rank_with_rows"] = _buffers_from_the_first_rank_with_rows
    out["buffers_without_check_batch"] = _buffers_without_check_batch
    out["no_tensor_to_split"] = _no_tensor_to_split
    out["mismatched_batch"] = _mismatched_batch
    out["programs_gathered"] = functools.partial(_programs_kept, True)
    out["programs_local"] = functools.partial(_programs_kept, False)
    out["programs_per_rank"] = functools.partial(_programs_kept, True, "per_rank")
    out["one_rank_bad_inputs"] = _one_rank_bad_inputs
    out["mismatched_values"] = _mismatched_values
    out["one_rank_bad_structure"] = _one_rank_bad_structure
    out["one_rank_cannot_gather"] = _one_rank_cannot_gather
    out["channels_last_outputs"] = _channels_last_outputs
    out["one_rank_sums_an_int_beyond_int64"] = _one_rank_sums_an_int_beyond_int64
    out["outputs_need_grad_on_some_ranks_only"] = _outputs_need_grad_on_some_ranks_only
    out["shard_helpers"] = _shard_helpers
    out["cost_balanced_split"] = _cost_balanced_split
    out["cost_values_differ_across_ranks"] = _cost_values_differ_across_ranks
    return out


def _views(b):
    g = torch.Generator().manual_seed(300 + b)
    return torch.randn(b, 6, dtype=DT, generator=g), torch.randn(b, 6, dtype=DT, generator=g)


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return torch.tanh(self.bn(self.lin(x)))


def _sync_batchnorm_vs_full_batch(b):
    """dpfast.nn.SyncBatchNorm across the ranks equals BatchNorm on the full batch: outputs, gradients, running
    statistics. (torch's own SyncBatchNorm needs a GPU, so it is not the reference here.)"""
    torch.manual_seed(0)
    plain = _BNNet().to(DT)
    ddp = dpfast.DistributedDataParallel(dpfast.nn.convert_sync_batchnorm(copy.deepcopy(plain)), gather_outputs=True)
    for step in range(2):
        x = torch.randn(b, 4, dtype=DT, generator=torch.Generator().manual_seed(step))
        out, ref = ddp(x), plain(x)
        torch.testing.assert_close(out, ref)
        ddp.zero_grad()
        plain.zero_grad()
        (out * out.detach().cos()).sum().backward()
        (ref * ref.detach().cos()).sum().backward()
        for (name, p), (_, q) in zip(ddp.module.named_parameters(), plain.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        for (name, x1), (_, x2) in zip(ddp.module.named_buffers(), plain.named_buffers()):
            torch.testing.assert_close(x1, x2, msg=lambda m, name=name: f"buffer {name}: {m}")


def _buffers_from_the_first_rank_with_rows():
    """chunk_sizes [0, 1, ...]: rank 0 never has rows, so its BatchNorm statistics never move; DDP broadcast them
    to every rank at each forward, so no rank's ever moved. The buffers now come from the first rank with rows, as
    DataParallel with the same specs keeps the first replica's that had rows."""
    world = dist.get_world_size()
    weights = [0] + [1] * (world - 1)
    torch.manual_seed(0)
    plain = _BNNet().to(DT)
    ddp = dpfast.DistributedDataParallel(copy.deepcopy(plain), gather_outputs=True, chunk_sizes=weights)
    dp = dpfast.DataParallel(copy.deepcopy(plain), ["cpu"] * world, chunk_sizes=weights)
    xs = [torch.randn(2 * world + 1, 4, dtype=DT, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for x in xs:
        ddp(x).sum().backward()
    with solo_context():
        for x in xs:
            dp(x).sum().backward()
    ddp.eval()
    dp.eval()
    out = ddp(xs[0])  # the broadcast at the start of this forward is what every rank keeps
    with solo_context():
        ref = dp(xs[0])
    torch.testing.assert_close(out, ref)
    for (name, b), (_, want) in zip(ddp.module.named_buffers(), dp.module.named_buffers()):
        torch.testing.assert_close(b, want, msg=lambda m, name=name: f"buffer {name}: {m}")
    assert not torch.equal(ddp.module.bn.running_mean, plain.bn.running_mean)


class _Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros((), dtype=DT))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.lin(x)


def _buffers_without_check_batch():
    """check_batch=False: the ranks may plan different batches, so they cannot be trusted to agree on the first rank
    with rows; the buffers come from rank 0, as torch's DDP has them (a disagreement was a hang)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ddp = dpfast.DistributedDataParallel(_Seen().to(DT), chunk_sizes=[0] + [1] * (world - 1), check_batch=False)
    ddp(torch.randn(0 if rank == 0 else 2, 2, dtype=DT)).sum().backward()  # rank 0: nothing to split; the others do
    ddp(torch.randn(2, 2, dtype=DT)).sum().backward()  # rank 1 had rows first above: a source only it would pick
    assert ddp._checks.buffer_source == 0
    dist.barrier()


def _cost_balanced_split():
    """cost=: full-batch outputs and gradients as without it, on a split that is not the count split; the rows a
    rank runs are shard_batch's with the same cost."""
    world = dist.get_world_size()
    ddp = _compare_with_full_batch(
        ByLength, _lengthsxy(), lambda o: o[0] + o[1].sum(), dict(out_dims=("mean", 0), cost="lengths")
    )
    prefix = [0] + torch.tensor(SORTED_LENGTHS).cumsum(0).long().tolist()
    assert list(ddp.share.sizes) == dpfast.plan.splits.balanced_split(prefix, world)
    assert list(ddp.share.sizes) != dpfast.plan.splits.split_sizes(len(SORTED_LENGTHS), world)
    x, lengths = _lengthsxy()
    part = shard_batch({"x": x, "lengths": lengths}, cost="batch['lengths']")
    torch.testing.assert_close(part["x"], x[ddp.share.start : ddp.share.stop])


def _cost_values_differ_across_ranks():
    """Same shapes, other cost values on one rank: the ranks would cut different rows; every rank raises instead."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(ByLength().to(DT), out_dims=("mean", 0), cost="lengths", gather_outputs=True)
    x, lengths = _lengthsxy()
    if rank == 1:
        lengths = lengths.flip(0)
    _expect_batch_error(ddp, x, lengths, contains=("different splits", "by cost"))
    out = ddp(*_lengthsxy())  # the group is still usable
    (out[0] + out[1].sum()).backward()


def _local_loss_scale(b):
    """Without gather_outputs: a local per-sample-mean loss times loss_scale gives the full-batch gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = nn.Linear(4, 2).to(DT)
    ref = copy.deepcopy(module)
    x, y = xy(b)
    F.mse_loss(ref(x), y).backward()
    ddp = dpfast.DistributedDataParallel(module)
    pred = ddp(x)
    assert pred.shape == (ddp.share.size, 2)
    y_local = shard_batch(y, rank, world)
    torch.testing.assert_close(pred, ref(x)[ddp.share.start : ddp.share.stop].detach())
    (F.mse_loss(pred, y_local) * ddp.loss_scale).backward() if ddp.share.size else (pred.sum() * 0).backward()
    torch.testing.assert_close(ddp.module.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ddp.module.bias.grad, ref.bias.grad)


def _no_tensor_to_split():
    """Nothing to split (every input has spec None): every rank runs it whole, rank 0's outputs count."""
    _compare_with_full_batch(
        Losses, xy(3), losses_loss, dict(in_dims={"x": None, "y": None}, out_dims=("mean", "sum", 0))
    )


def _expect_batch_error(ddp, *inputs, contains=()):
    return expect_batch_error(lambda: ddp(*inputs), contains)


def _mismatched_batch():
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0), gather_outputs=True)
    _expect_batch_error(ddp, *xy(4 + rank), contains=("B differs across ranks",))
    # same B, another feature size on the last rank
    x, y = xy(4)
    if rank == dist.get_world_size() - 1:
        y = torch.randn(4, 3, dtype=DT)
    _expect_batch_error(ddp, x, y, contains=("same B = 4",))
    # the group is still usable afterwards
    out = ddp(*xy(4))
    losses_loss(out).backward()


def _programs_kept(gather, inputs="global"):
    """Steps of one structure are planned by the program their first call compiled, and still train exactly as
    the full batch; a rank whose next call differs (a program of its own) makes every rank raise, and the group is
    usable afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = Losses().to(DT)
    ref = copy.deepcopy(module)
    ddp = dpfast.DistributedDataParallel(module, out_dims=("mean", "sum", 0), gather_outputs=gather, inputs=inputs)
    mine = shard_range(5, rank, world) if inputs == "per_rank" else slice(None)
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        x, y = torch.randn(5, 4, dtype=DT, generator=g), torch.randn(5, 2, dtype=DT, generator=g)
        ddp.zero_grad()
        ref.zero_grad()
        out = ddp(x[mine], y[mine])
        with solo_context():
            expected = ref(x, y)
        if gather:
            assert_tree_close(out, expected, f"step {step}: gathered outputs")
            losses_loss(out).backward()
        else:  # this rank's rows: a per-sample-mean loss scaled to the full batch's gradient
            s = ddp.share
            assert_tree_close(out[2], expected[2][s.start : s.stop], f"step {step}: this rank's outputs")
            (out[0] * ddp.loss_scale).backward()
        (expected[0] if not gather else losses_loss(expected)).backward()
        got, want = grads(ddp.module), grads(ref)
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name, s=step: f"step {s}, {n}: {m}")
    programs = ddp._specs.programs
    assert programs.compiled == 1, programs.compiled  # the first step's program ran every later step
    x, y = (t[mine] for t in xy(5))
    if rank == world - 1:  # (per-rank shares may differ in rows, not in dtype)
        x, y = xy(4) if inputs == "global" else (x, y.float())

    def call():
        out = ddp(x, y)
        (losses_loss(out) if gather else out[0]).backward()  # without gather_outputs backward checks

    expect_batch_error(call, ("B differs across ranks",) if inputs == "global" else ())
    assert programs.compiled == 1 + (inputs == "per_rank" and rank == world - 1)  # (a dtype is another key)
    out = ddp(*(t[mine] for t in xy(5)))
    (losses_loss(out) if gather else out[0]).backward()


def _one_rank_bad_inputs():
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(RRN().to(DT), in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True)
    x, hid, h = rrn_inputs(5)
    if rank == 1:
        h = (h[0][:, :4], h[1])  # a ScatterError on rank 1 only: every rank must raise, none may hang
    msg = _expect_batch_error(ddp, x, hid, h, contains=("rank 1 could not split its inputs",))
    if rank == 1:
        assert "suggested fix: dpfast.DistributedDataParallel(..., " in msg, msg  # written as a call of DDP


def _one_rank_bad_structure():
    """An argument whose structure does not match its spec on one rank only (in_dims={'h': (1, 1)} but h is one
    tensor): that rank raised TypeError at once while the others waited in the batch agreement until the timeout."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(RRN().to(DT), in_dims={"h": (1, 1)}, out_dims=(0, 0, 1), gather_outputs=True)
    x, hid, h = rrn_inputs(5)
    if rank == 1:
        h = h[0]
    t0 = time.monotonic()
    msg = _expect_batch_error(ddp, x, hid, h, contains=("rank 1 could not split its inputs",))
    assert time.monotonic() - t0 < 20, "a rank waited for a collective timeout"
    if rank == 1:
        assert "is a tuple of 2 specs" in msg, msg


class Squeezed(nn.Module):
    """Returns (n, 2) per rank but squeezes a 1-row share to (2,): out_dims 1 is out of range on that rank only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x).squeeze(0)


def _one_rank_cannot_gather():
    """An output that one rank cannot gather (axis out of range there only) raised on that rank before the
    output exchange, and the other ranks waited in it until the timeout."""
    world = dist.get_world_size()
    ddp = dpfast.DistributedDataParallel(Squeezed().to(DT), out_dims=1, gather_outputs=True)
    x, _ = xy(2 * world - 1)  # the last rank gets one row
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"rank {world - 1} could not gather its outputs") as e:
        ddp(x)
    assert time.monotonic() - t0 < 20, "a rank waited for a collective timeout"
    for rank in range(world):
        assert f"rank {rank}" in str(e.value)
    out = dpfast.DistributedDataParallel(Squeezed().to(DT), out_dims=0, gather_outputs=True)(xy(2 * world)[0])
    assert out.shape == (2 * world, 2)  # the group is still usable


class ConvMaps(nn.Module):
    """Feature maps of a channels_last input (channels_last too), and their mean over the batch (made
    channels_last: a mean over the batch axis is contiguous)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y, y.mean(0, keepdim=True).contiguous(memory_format=torch.channels_last)


def _channels_last_outputs():
    """Gathered channels_last outputs came back contiguous (right values, another memory format than torch.cat of
    all-gathered copies gives): now channels_last, with the full batch's values and gradients, on every rank, a
    rank without rows too."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(5)  # the same batch on every rank, whatever ran before
    x = torch.randn(2 * world + 1, 3, 5, 5, dtype=DT, generator=g).contiguous(memory_format=torch.channels_last)

    def loss(out):
        return out[0].pow(2).sum() + out[1].pow(2).sum()

    ddp = _compare_with_full_batch(ConvMaps, (x,), loss, dict(out_dims=(0, "mean")))
    for out in ddp(x):
        assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous(), out.stride()
    maps, _ = ddp(x.contiguous())  # the same sizes, another format: read again, not taken from the last call
    assert maps.is_contiguous(), maps.stride()
    # the last rank has no rows: its empty maps read as contiguous, but every rank's gathered ones are channels_last
    with torch.no_grad():
        few = x[: world - 1]
        with solo_context():
            expected = ddp.module(few)
        for out, want in zip(ddp(few), expected):
            assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous(), out.stride()
            torch.testing.assert_close(out, want)


class RankDependent(nn.Module):
    """A linear map whose outputs differ by rank in a way only that rank sees: a Python number beside them, or
    outputs detached on one rank."""

    def __init__(self, extra):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.extra = extra

    def forward(self, x):
        return self.extra(dist.get_rank(), self.lin(x))


def _one_rank_sums_an_int_beyond_int64():
    """One rank's "sum" output is a Python int no int64 holds: every rank raises, saying which output and what to
    return (torch's own conversion error said neither, and where it is a RuntimeError no rank reported it: the
    others waited in the exchange until the timeout)."""
    world = dist.get_world_size()
    ddp = dpfast.DistributedDataParallel(
        RankDependent(lambda rank, y: (y, 2**70 if rank == 1 else 1)).to(DT), out_dims=(0, "sum"), gather_outputs=True
    )
    x, _ = xy(2 * world)
    expect_batch_error(lambda: ddp(x), contains=("rank 1 could not gather its outputs", "which int64 cannot hold"))
    y, total = dpfast.DistributedDataParallel(
        RankDependent(lambda rank, y: (y, 1)).to(DT), out_dims=(0, "sum"), gather_outputs=True
    )(x)
    assert y.shape == (2 * world, 2) and total == world  # the group is still usable


def _outputs_need_grad_on_some_ranks_only():
    """Outputs that need grad on rank 0 and not on the others (detached there): every rank gathered, rank 0's
    backward all-reduced the outputs' gradients and waited for ranks that never would until the timeout."""
    world = dist.get_world_size()
    ddp = dpfast.DistributedDataParallel(
        RankDependent(lambda rank, y: y if rank == 0 else y.detach()).to(DT), gather_outputs=True
    )
    x, _ = xy(2 * world)
    expect_batch_error(lambda: ddp(x).sum().backward(), contains=("need grad",))
    with torch.no_grad():  # the same module is fine where no rank's outputs need grad
        assert ddp(x).shape == (2 * world, 2)


def _mismatched_values():
    """Without gather_outputs the check rides in the first gradient bucket: the mismatch raises from backward()."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0), check_batch="values")
    x, y = xy(4)
    ddp(x, y)[0].backward()  # same values: fine
    if rank == 0:
        x = x + 1
    expect_batch_error(lambda: ddp(x, y)[0].backward(), contains=("`x values`",))


def _shard_helpers():
    rank, world = dist.get_rank(), dist.get_world_size()
    b = 7
    x, hid, h = rrn_inputs(b)
    part = shard_batch((x, hid, h), in_dims=(0, 0, 1))  # rank/world from the process group
    r = shard_range(b)
    assert part[0].shape[0] == len(r)
    torch.testing.assert_close(part[0], x[r.start : r.stop])
    torch.testing.assert_close(part[2][1], h[1][:, r.start : r.stop])
    # the shard of the batch is what DDP feeds the module on this rank
    seen = {}

    class Spy(RRN):
        def forward(self, x, hidden, h):
            seen["args"] = (x, hidden, h)
            return super().forward(x, hidden, h)

    ddp = dpfast.DistributedDataParallel(Spy().to(DT), in_dims={"h": 1}, out_dims=(0, 0, 1))
    ddp(x, hid, h)
    assert_tree_close(seen["args"], part, "module inputs vs shard_batch")
    assert shard_range(10, rank, world, chunk_sizes=[0] + [1] * (world - 1)) == (
        range(0) if rank == 0 else shard_range(10, rank - 1, world - 1)
    )
    ds = shard_dataset(list(range(10)))
    assert list(ds) == list(shard_range(10))


# ---- the spawned group -------------------------------------------------------------------------------------------

RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()


# ---- no process group needed -------------------------------------------------------------------------------------


def test_shard_range_partitions_like_data_parallel():
    for n in range(0, 12):
        for world in (1, 2, 3, 5):
            ranges = [shard_range(n, r, world) for r in range(world)]
            assert [i for rg in ranges for i in rg] == list(range(n))
            assert [len(rg) for rg in ranges] == dpfast.plan.splits.split_sizes(n, world)


def test_shard_batch_specs_and_errors():
    x, hid, h = rrn_inputs(5)
    parts = [
        shard_batch({"x": x, "h": h, "mask": torch.ones(3, 3)}, r, 3, in_dims={"h": 1, "mask": None}) for r in range(3)
    ]
    assert [p["x"].shape[0] for p in parts] == [2, 2, 1]
    assert [p["h"][0].shape[1] for p in parts] == [2, 2, 1]
    assert all(p["mask"].shape == (3, 3) for p in parts)
    torch.testing.assert_close(torch.cat([p["h"][1] for p in parts], 1), h[1])
    assert shard_batch(x, 6, 8).shape == (0, 3, 3)  # B < world: an empty share
    with pytest.raises(dpfast.ScatterError, match="suggested fix"):
        shard_batch((x, h), 0, 2)
    with pytest.raises(ValueError, match="rank and world_size"):
        shard_batch(x)
    with pytest.raises(ValueError, match="rank must be"):
        shard_batch(x, 3, 3)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        dpfast.DistributedDataParallel(nn.Linear(2, 2))


def test_shard_batch_packed_sequence_with_empty_shares():
    """A PackedSequence share when another rank's share is empty (B < world, or a zero weight) crashed with
    `max(): Expected reduction dim` on the ranks that do have rows (scatter_packed was given the zero chunks)."""
    from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

    seqs = [torch.randn(3, 2), torch.randn(2, 2), torch.randn(4, 2)]
    ps = pack_sequence(seqs, enforce_sorted=False)
    for world, weights in ((4, None), (3, [1, 0, 2]), (5, [0, 1, 0, 1, 1])):
        sizes = dpfast.plan.splits.split_sizes(3, world, dpfast.plan.splits.validate_chunk_sizes(weights, world))
        start = 0
        for r in range(world):
            if sizes[r] == 0:
                with pytest.raises(ValueError, match="cannot hold zero sequences"):
                    shard_batch(ps, r, world, chunk_sizes=weights)
                continue
            part = shard_batch(ps, r, world, chunk_sizes=weights)
            padded, lengths = pad_packed_sequence(part, batch_first=True)
            want = seqs[start : start + sizes[r]]
            assert lengths.tolist() == [len(s) for s in want]
            for row, s in zip(padded, want):
                torch.testing.assert_close(row[: len(s)], s)
            start += sizes[r]
