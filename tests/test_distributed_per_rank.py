"""``inputs="per_rank"``: each rank passes only its own rows, as DDP users load data (issue 27, item 5).

The same in_dims/out_dims apply; gather_outputs gathers variable-size shares in rank order and a loss on them gives
the full-batch gradients; "mean"/"sum" reduce over uneven shares; loss_scale makes a local mean loss exact; the
ranks still check that their batches have the same structure; and BalancedBatchSampler feeds it without any rank
reading another's samples. Before, every rank had to be given the global batch.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpfast
from dpfast.distributed import BalancedBatchSampler, shard_batch
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
from dp_testing import DT, Losses


def _per_rank(global_batch, in_dims=None, chunk_sizes=None):
    return shard_batch(global_batch, in_dims=in_dims, chunk_sizes=chunk_sizes)


def _full_batch_check(factory, global_inputs, loss_fn, ddp_kwargs, in_dims=None, chunk_sizes=None):
    """Each rank passes its own rows; the gathered outputs and every parameter's gradient equal the single-process
    run on the global batch, and each rank's input gradients are the full-batch ones of its rows."""
    torch.manual_seed(0)
    module = factory().to(DT)
    ref = copy.deepcopy(module)
    ddp = dpfast.DistributedDataParallel(module, inputs="per_rank", gather_outputs=True, **ddp_kwargs)
    full = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), global_inputs)
    mine = torch.utils._pytree.tree_map(
        lambda t: t.detach().clone().requires_grad_(), _per_rank(global_inputs, in_dims, chunk_sizes)
    )
    with solo_context():
        expected = ref(*full)
    got = ddp(*mine)
    assert_tree_close(got, expected, "gathered outputs")
    loss_fn(expected).backward()
    loss_fn(got).backward()
    for name, want in grads(ref).items():
        torch.testing.assert_close(grads(ddp.module)[name], want, msg=lambda m, name=name: f"grad of {name}: {m}")
    want_rows = _per_rank(torch.utils._pytree.tree_map(lambda t: t.grad, full), in_dims, chunk_sizes)
    assert_tree_close(torch.utils._pytree.tree_map(lambda t: t.grad, mine), want_rows, "input gradients")
    return ddp


def _rrn(b):
    ddp = _full_batch_check(RRN, rrn_inputs(b), rrn_loss, dict(in_dims={"h": 1}, out_dims=(0, 0, 1)), in_dims=(0, 0, 1))
    world, rank = dist.get_world_size(), dist.get_rank()
    assert ddp.share.batch_size == b and sum(ddp.share.sizes) == b and len(ddp.share.sizes) == world
    assert ddp.share.start == sum(ddp.share.sizes[:rank])


def _reasoning_without_gather(b):
    """Each rank feeds its own returned state back (no gather) and scales its local loss by loss_scale: the
    gradients are the full-batch ones. Before, the fed-back state's gradient was scaled by 1/W at every call, as a
    leaf input's is, though it flows on into the earlier call's graph (parameter gradients 1/W too small there)."""
    torch.manual_seed(0)
    module = RRN().to(DT)
    ref = copy.deepcopy(module)
    x, hid, h = rrn_inputs(b)
    with solo_context():
        args, want = (x, hid, h), []
        for _ in range(2):
            out = ref(*args)
            want.append(out)
            args = (x,) + tuple(out[1:])
    sum(_mean_rrn_loss(o) for o in want).backward()
    ddp = dpfast.DistributedDataParallel(module, inputs="per_rank", in_dims={"h": 1}, out_dims=(0, 0, 1))
    xr, hid_r, h_r = _per_rank((x, hid, h), in_dims=(0, 0, 1))
    args, losses = (xr, hid_r, h_r), []
    for _ in range(2):
        out = ddp(*args)
        losses.append(_mean_rrn_loss(out))
        args = (xr,) + tuple(out[1:])
    (sum(losses) * ddp.loss_scale).backward()
    for name, g in grads(ref).items():
        torch.testing.assert_close(grads(ddp.module)[name], g, msg=lambda m, name=name: f"grad of {name}: {m}")


def _mean_rrn_loss(outputs):
    """A per-sample mean over the rows given (times loss_scale, over the ranks' rows: the full batch's)."""
    out, hidden, (hn, cn) = outputs
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape[1:], dtype=DT, generator=g)
    w_h = torch.randn(hn.shape[-1], dtype=DT, generator=g)
    per_sample = (out * w_out).sum((1, 2)) + hidden.pow(2).mean((1, 2))
    per_sample = per_sample + (hn * w_h).sum((0, 2)) + cn.pow(2).sum((0, 2))
    return per_sample.mean() if len(per_sample) else per_sample.sum()


def _example_checks():
    """examples/ddp_rrn.py's float64 check, global batch and per-rank rows, on the seed's RRN."""
    from dpfast.__main__ import load_example

    example = load_example("ddp_rrn")
    cfg = example.Config(batch=6)
    for per_rank in (False, True):
        worst = example.check(cfg, torch.device("cpu"), 6, per_rank)
        assert worst < 1e-9, worst


def _uneven_mean_and_sum():
    """Shares of 3 and 1 rows (and 3, 1, 2): "mean" is weighted by share, "sum" adds every rank's."""
    world = dist.get_world_size()
    weights = [3, 1, 2][:world]
    _full_batch_check(Losses, xy(sum(weights)), losses_loss, dict(out_dims=("mean", "sum", 0)), chunk_sizes=weights)


def _a_rank_without_rows():
    """One rank passes zero rows (a loader's last, short step): its empty batch contributes nothing."""
    world = dist.get_world_size()
    weights = [1] * (world - 1) + [0]
    _full_batch_check(Losses, xy(world + 1), losses_loss, dict(out_dims=("mean", "sum", 0)), chunk_sizes=weights)


def _loss_scale_without_gather():
    """No gather: a local per-sample-mean loss times loss_scale (W * n_r / B, B summed over the ranks' shares)
    gives the full-batch gradient on uneven shares."""
    world = dist.get_world_size()
    weights = [3, 1, 2][:world]
    torch.manual_seed(0)
    module = nn.Linear(4, 2).to(DT)
    ref = copy.deepcopy(module)
    x, y = xy(sum(weights))
    F.mse_loss(ref(x), y).backward()
    ddp = dpfast.DistributedDataParallel(module, inputs="per_rank")
    xr, yr = _per_rank((x, y), chunk_sizes=weights)
    loss = F.mse_loss(ddp(xr), yr)
    assert ddp.share.sizes == tuple(len(p) for p in _all_shares(x, weights)) and ddp.share.batch_size == len(x)
    (loss * ddp.loss_scale).backward()
    torch.testing.assert_close(ddp.module.weight.grad, ref.weight.grad)
    torch.testing.assert_close(ddp.module.bias.grad, ref.bias.grad)


def _all_shares(x, weights):
    return [shard_batch(x, r, dist.get_world_size(), chunk_sizes=weights) for r in range(dist.get_world_size())]


def _sizes_may_differ():
    """Different row counts, and other non-batch sizes, on every rank: nothing to complain about."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(nn.GRU(3, 4, batch_first=True).to(DT), inputs="per_rank")
    for step in range(2):
        x = torch.randn(2 + rank, 5 + rank + step, 3, dtype=DT)
        out, h = ddp(x)
        (out.sum() + h.sum()).backward()


def _structure_mismatch():
    """Per-rank batches may differ in size only: a dtype or a key differing on one rank raises on every rank,
    on the first call (before anything runs) and on a later one (in the step's check)."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(
        Losses().to(DT), inputs="per_rank", out_dims=("mean", "sum", 0), gather_outputs=True
    )
    x, y = xy(2 + rank)
    expect_batch_error(lambda: ddp(x, y.float() if rank == 1 else y), contains=("differ in `y`",))
    losses_loss(ddp(x, y)).backward()  # fine again
    msg = expect_batch_error(lambda: ddp(x, y.float() if rank == 1 else y), contains=("differ in `y`",))
    assert "torch.float32" in msg and "torch.float64" in msg, msg
    losses_loss(ddp(x, y)).backward()


def _bad_batch_on_one_rank():
    """A ScatterError on one rank's own batch: that rank still keeps step, and every rank raises."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), inputs="per_rank", out_dims=("mean", "sum", 0))
    x, y = xy(3)
    ddp(x, y)[0].backward()
    bad_y = y[:2] if rank == 1 else y
    msg = expect_batch_error(lambda: ddp(x, bad_y)[0].backward(), contains=("rank 1 could not split its inputs",))
    if rank == 1:
        assert "suggested fix" in msg, msg
    ddp(x, y)[0].backward()  # the group is still usable


class _Recorded(torch.utils.data.Dataset):
    """A dataset that remembers which samples it was asked for."""

    def __init__(self, x, y):
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.read.append(i)
        return self.x[i], self.y[i]


def _sampler_loading():
    """BalancedBatchSampler + per-rank inputs: every rank reads only its own samples, and the gathered outputs are
    the module's on each global batch, in the sampler's order."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(9)
    n = 23
    x, y = torch.randn(n, 4, dtype=DT, generator=g), torch.randn(n, 2, dtype=DT, generator=g)
    costs = torch.randint(1, 50, (n,), generator=g)
    dataset = _Recorded(x, y)
    sampler = BalancedBatchSampler(costs, 8, seed=4)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    torch.manual_seed(0)
    module = Losses().to(DT)
    ddp = dpfast.DistributedDataParallel(module, inputs="per_rank", out_dims=("mean", "sum", 0), gather_outputs=True)
    mine = [i for b in sampler for i in b]
    for batch, (xb, yb) in zip(sampler.global_batches(), loader):
        mse, sse, pred = ddp(xb, yb)
        with solo_context():
            want = module(x[batch], y[batch])
        assert_tree_close((mse, sse, pred), want, "gathered outputs")
        losses_loss((mse, sse, pred)).backward()
    assert sorted(dataset.read) == sorted(mine), "a rank read samples that are not its own"
    everyone = [None] * world
    dist.all_gather_object(everyone, sorted(dataset.read))
    assert sorted(i for r in everyone for i in r) == list(range(n))


def _outputs_grow():
    """Gathered outputs that grow from step to step: the exchange's capacity follows (a second all-gather only
    when a payload does not fit)."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(nn.Linear(4, 3).to(DT), inputs="per_rank", gather_outputs=True)
    for rows in (1, 4, 9, 2, 9):
        x = torch.randn(rows + rank, 4, dtype=DT)
        out = ddp(x)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, x)
        with solo_context():
            torch.testing.assert_close(out, ddp.module(torch.cat(everyone)))
        out.sum().backward()


class _Shapes(nn.Module):
    """Outputs of the structure ``kind`` names: one tensor, a tuple with a leaf gathered along its last axis, or a
    dict with a kept None, a mean and a float64 tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, kind):
        y = self.lin(x)
        if kind == "tensor":
            return y
        if kind == "tuple":
            return y, y.t()
        return {"y": y, "none": None, "mean": y.mean(), "wide": y.double().repeat(1, 2)}


_SHAPES_OUT_DIMS = {"tensor": 0, "tuple": (0, 1), "dict": {"y": 0, "mean": "mean", "wide": 0}}


def _weighted_loss(out):
    """A loss on every tensor of the outputs (each element its own weight), after the first is doubled in place:
    every gathered output's gradient is exercised, and a gathered output may be modified in place."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    tensors[0].mul_(2)
    return sum((t * torch.arange(1.0, 1 + t.numel(), dtype=t.dtype).view(t.shape)).sum() for t in tensors)


def _outputs_change():
    """Outputs that change from step to step, and repeat: every gathered one, every parameter's gradient and every
    rank's input gradient equal the full batch's, whether the layout is kept or walked again, the ranks' rows equal
    (one block per tensor) or not, or a rank has none."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrappers = {
        kind: dpfast.DistributedDataParallel(_Shapes().to(DT), inputs="per_rank", gather_outputs=True, out_dims=dims)
        for kind, dims in _SHAPES_OUT_DIMS.items()
    }
    steps = [("tensor", 3), ("tensor", 3), ("tensor", None), ("tensor", None), ("tuple", 2), ("tuple", 2)]
    steps += [("tuple", None), ("dict", 4), ("dict", 4), ("dict", None), ("dict", None), ("tensor", 3)]
    steps += [("tuple", 0), ("tensor", 1)]  # a rank with one row and the others none (rank 0's, below)
    for kind, rows in steps:
        mine = rows if rows is not None else 1 + rank  # None: uneven shares (rank 0's one row)
        if rows is not None and kind == "dict" and rank == world - 1:
            mine = 0  # the dict's mean over a rank without rows: weighted by share
        if rows in (0, 1):
            mine = 1 if rank == 0 else 0
        x = torch.randn(mine, 4, dtype=DT, requires_grad=True)
        ddp = wrappers[kind]
        ddp.module.zero_grad(set_to_none=True)
        out = ddp(x, kind)
        everyone = [None] * world
        dist.all_gather_object(everyone, x.detach())
        with solo_context():
            full = torch.cat(everyone).requires_grad_()
            # (the gathered outputs are tensors of their own: y.t() of the reference must not double with y)
            want = torch.utils._pytree.tree_map(lambda t: t if t is None else t.clone(), ddp.module(full, kind))
            params = list(ddp.module.parameters())
            want_grads = torch.autograd.grad(_weighted_loss(want), [full, *params])
        if kind == "dict":
            assert out["none"] is None
            out, want = {k: v for k, v in out.items() if k != "none"}, {k: v for k, v in want.items() if k != "none"}
        _weighted_loss(out).backward()
        what = f"{kind} outputs, rows {rows}"
        assert_tree_close(out, want, what)  # (both doubled in place)
        for p, g in zip(params, want_grads[1:]):
            torch.testing.assert_close(p.grad, g, msg=lambda m, what=what: f"{what}: a parameter gradient: {m}")
        start = sum(e.shape[0] for e in everyone[:rank])
        own_rows = want_grads[0][start : start + mine]
        torch.testing.assert_close(x.grad, own_rows, msg=lambda m, what=what: f"{what}: x.grad {m}")


def _scenarios(world):
    return {
        "rrn_B7": functools.partial(_rrn, 7),
        "rrn_B_world": functools.partial(_rrn, world),  # one row per rank (the RRN refuses an empty batch)
        "reasoning_without_gather": functools.partial(_reasoning_without_gather, 7),
        "example_checks": _example_checks,
        "uneven_mean_and_sum": _uneven_mean_and_sum,
        "a_rank_without_rows": _a_rank_without_rows,
        "loss_scale_without_gather": _loss_scale_without_gather,
        "sizes_may_differ": _sizes_may_differ,
        "structure_mismatch": _structure_mismatch,
        "bad_batch_on_one_rank": _bad_batch_on_one_rank,
        "sampler_loading": _sampler_loading,
        "outputs_grow": _outputs_grow,
        "outputs_change": _outputs_change,
    }


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
