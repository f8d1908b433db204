"""When the ranks check that they agree (issue 27, item 4): inside collectives the step runs anyway, so a step costs no
collective and no blocking call more than torch's DDP step; and the guarantee holds on every step, not only the
first: a mismatch or a rank that cannot plan its call is a clear error on every rank, never a hang.

Before, every forward ran one blocking all-gather of its own (and gather_outputs two more): more collectives, and
more blocking calls, than torch's DDP step (plus torch.distributed.nn.functional.all_gather of the outputs).
"""

from __future__ import annotations

import collections
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import dpfast
from dpfast.distributed.agreement import StepChecks
from dpfast.distributed.bucket_check import BucketCheck, NativeBucketCheck

from ddp_harness import GroupRuns, expect_batch_error, losses_loss, xy
from dp_testing import DT, Losses

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "_broadcast_coalesced",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "gather",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
)


@contextlib.contextmanager
def _counting():
    """Every torch.distributed collective called from Python (DDP's reducer runs them through the Python comm hook
    the caller registers), as (name, blocking)."""
    calls: list[tuple[str, bool]] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, not kwargs.get("async_op", False)))
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _native_collectives(ddp):
    """The all-reduces dpfast's C++ check hook issued (not seen by the Python counter); 0 without one."""
    check = getattr(ddp, "_bucket_check", None)
    return check.collectives if isinstance(check, NativeBucketCheck) else 0


def _per_step(step, steps=4, ddp=None):
    for _ in range(3):  # warm up: the first call's check, DDP's bucket rebuild, the exchange's capacity
        step()
    native = _native_collectives(ddp)
    with _counting() as calls:
        for _ in range(steps):
            step()
    calls += [("all_reduce", False)] * (_native_collectives(ddp) - native)  # async: the hook waits for nothing
    counts = collections.Counter(calls)
    return {k: v / steps for k, v in counts.items()}


def _blocking(counts):
    return sum(v for (_, blocking), v in counts.items() if blocking)


def _total(counts):
    return sum(counts.values())


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x))


def _steps(factory, gather, inputs_mode):
    """A torch DDP step on this rank's rows and a dpfast one (global batch or per-rank rows), the same model."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(8 * world, 4, dtype=DT)
    mine = x[8 * rank : 8 * (rank + 1)]
    plain = nn.parallel.DistributedDataParallel(factory().to(DT))
    plain.register_comm_hook(None, default_hooks.allreduce_hook)  # so the counter sees its all-reduce
    kwargs = dict(gather_outputs=gather, inputs=inputs_mode)
    ddp = dpfast.DistributedDataParallel(factory().to(DT), **kwargs)
    if gather:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    def torch_step():
        plain.zero_grad()
        out = plain(mine)
        if gather:
            out = torch.cat(dist_nn.all_gather(out))
        out.pow(2).mean().backward()

    def dpfast_step():
        ddp.zero_grad()
        ddp(x if inputs_mode == "global" else mine).pow(2).mean().backward()

    return torch_step, dpfast_step, ddp


def _no_more_than_torch(factory, gather, inputs_mode):
    torch_step, dpfast_step, ddp = _steps(factory, gather, inputs_mode)
    theirs, ours = _per_step(torch_step), _per_step(dpfast_step, ddp=ddp)
    assert ours.get(("all_reduce", False), 0) >= 1, f"dpfast's gradient all-reduce went uncounted: {dict(ours)}"
    exchanges = sum(v for (name, _), v in ours.items() if name.startswith("all_gather"))
    assert exchanges == (1 if gather else 0), f"the output exchange went uncounted: {dict(ours)}"
    assert _total(ours) <= _total(theirs), f"collectives per step: dpfast {dict(ours)}, torch {dict(theirs)}"
    assert _blocking(ours) <= _blocking(theirs), f"blocking calls per step: dpfast {dict(ours)}, torch {dict(theirs)}"


def _mismatch_later(gather):
    """Step 1 agrees; at step 2 rank 1 has another B: every rank raises (in forward with gather_outputs, from
    backward() without), before any optimizer step could use the gradients."""
    rank = dist.get_rank()
    module = Losses().to(DT)
    ddp = dpfast.DistributedDataParallel(module, out_dims=("mean", "sum", 0), gather_outputs=gather)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(b):
        opt.zero_grad()
        losses_loss(ddp(*xy(b))).backward()
        opt.step()

    step(5)
    before = [p.detach().clone() for p in module.parameters()]
    expect_batch_error(lambda: step(5 + rank), contains=("B differs across ranks",))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before)), "an optimizer step ran"
    step(5)  # the group is still usable


class Scaled(nn.Module):
    """Takes a replicated tensor beside the batch (in_dims={"scale": None})."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, scale):
        return self.lin(x * scale.sum())


def _replicated_tensor_differs(gather, inputs):
    """A replicated tensor of another shape, or another dtype, on one rank: with the global batch every rank
    raises naming it (the record had only its spec, so the ranks ran on different values); with per-rank inputs
    its dtype still must agree, its shape may differ."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(Scaled().to(DT), in_dims={"scale": None}, gather_outputs=gather, inputs=inputs)
    x = xy(6)[0]
    one, two = torch.ones(1, dtype=DT), torch.full((2,), 0.5, dtype=DT)

    def step(scale):
        ddp(x, scale).sum().backward()

    step(one)
    if inputs == "global":
        expect_batch_error(lambda: step(two if rank == 1 else one), ["scale", "(2,)"])
    else:
        step(two if rank == 1 else one)  # each rank's own: its shape is its own
    expect_batch_error(lambda: step(one.float() if rank == 1 else one), ["scale", "torch.float32"])
    step(one)


class WithJagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, seq):
        return self.lin(x) + seq.values().sum()


def _jagged(*lengths):
    return torch.nested.nested_tensor([torch.ones(n, 3, dtype=DT) for n in lengths], layout=torch.jagged)


def _same_jagged_tensors_agree(split):
    """A jagged tensor's ragged size prints as a per-process symbol (j1, j2...): a rank that made one more jagged
    tensor before raised a disagreement over the very same batch. Split or replicated, they agree now."""
    if dist.get_rank() == 1:
        _jagged(1)  # (one more jagged tensor on this rank only, as a rank that logged or evaluated would make)
    in_dims = (0, 0) if split else (0, None)
    ddp = dpfast.DistributedDataParallel(WithJagged().to(DT), in_dims=in_dims)
    b = 6 if split else 4
    for _ in range(2):
        ddp(xy(b)[0][:b], _jagged(*range(1, 7)) if split else _jagged(2, 4)).sum().backward()


def _bad_inputs_later(module_factory, gather, no_grad):
    """A ScatterError on rank 1 only, after the first call: rank 1 keeps step with the others (their collectives
    replayed, its check row saying why) and every rank raises at the step's check."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = dpfast.DistributedDataParallel(module_factory().to(DT), gather_outputs=gather)
    x = torch.randn(6, 4, dtype=DT)
    y = torch.randn(6, 2, dtype=DT)
    ctx = torch.no_grad() if no_grad else contextlib.nullcontext()

    def step(y):
        with ctx:
            out = ddp(x, y)
        if not no_grad:
            out.sum().backward()

    step(y)
    expect_batch_error(lambda: step(y[:5] if rank == 1 else y), contains=("rank 1 could not split its inputs",))
    step(y)


class WithTarget(nn.Module):
    """A model with a per-sample second input (so a batch can be inconsistent on one rank)."""

    def __init__(self, sync=False):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.bn = dpfast.nn.SyncBatchNorm(2) if sync else nn.Identity()

    def forward(self, x, y):
        return self.bn(self.lin(x)) - y


def _no_sync_chain():
    """Under no_sync() no gradient is all-reduced, so the checks of the accumulation steps travel with the next
    synchronized backward: a mismatch in the first micro-batch raises there, before the optimizer step."""
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0))
    losses_loss(ddp(*xy(4))).backward()
    with ddp.no_sync():
        losses_loss(ddp(*xy(4 + (rank == 1)))).backward()  # no collective: nothing raises yet
        losses_loss(ddp(*xy(4))).backward()
    expect_batch_error(lambda: losses_loss(ddp(*xy(4))).backward(), contains=("B differs across ranks",))
    losses_loss(ddp(*xy(4))).backward()


def _forward_counts_differ():
    rank = dist.get_rank()
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0))
    losses_loss(ddp(*xy(4))).backward()
    if rank == 0:
        ddp(*xy(4))  # a forward whose outputs are dropped
    expect_batch_error(lambda: losses_loss(ddp(*xy(4))).backward(), contains=("different number of times",))


def _user_comm_hook():
    """A comm hook of the user's runs on every bucket, and the check still catches a mismatch (its table then
    takes an all-reduce of its own)."""
    rank = dist.get_rank()
    seen = []

    def hook(state, bucket):
        seen.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    ddp = dpfast.DistributedDataParallel(nn.Linear(4, 2).to(DT))
    ddp.register_comm_hook(None, hook)
    x = torch.randn(4, 4, dtype=DT)
    F.mse_loss(ddp(x), torch.zeros(ddp.share.size, 2, dtype=DT)).backward()
    assert seen, "the user's hook did not run"
    expect_batch_error(lambda: ddp(x[: 4 - rank]).sum().backward(), contains=("B differs across ranks",))


def _the_hook_in_use():
    """With the compiled extension, a CPU module's check is the C++ hook; without it (or on CUDA), the Python one.
    Either compares the rows itself: an agreeing step commits without Python decoding the table."""
    seen = collections.Counter()
    saved = StepChecks.agreed, StepChecks.verify

    def counted(name, fn):
        def wrapper(self, *args):
            seen[name] += 1
            return fn(self, *args)

        return wrapper

    StepChecks.agreed, StepChecks.verify = counted("agreed", saved[0]), counted("verify", saved[1])
    try:
        ddp = dpfast.DistributedDataParallel(nn.Linear(4, 2).to(DT))
    finally:
        StepChecks.agreed, StepChecks.verify = saved
    native = dpfast.build_info()["extension_loaded"]
    assert isinstance(ddp._bucket_check, NativeBucketCheck if native else BucketCheck), type(ddp._bucket_check)
    x = torch.randn(4, 4, dtype=DT)
    for _ in range(3):
        ddp(x).sum().backward()
    if native:
        assert ddp._bucket_check.collectives == 3  # one bucket: its all-reduce carried the table
    assert seen == {"agreed": 3}, seen  # (either hook takes an agreeing table by one comparison)


@contextlib.contextmanager
def _python_hook():
    """The Python comm hook (what CUDA buckets and the pure-Python fallback get), here on CPU buckets."""
    saved = dpfast.distributed.module.native_hook_available
    dpfast.distributed.module.native_hook_available = lambda module, group: False
    try:
        yield
    finally:
        dpfast.distributed.module.native_hook_available = saved


def _on_the_python_hook(scenario):
    with _python_hook():
        ddp = dpfast.DistributedDataParallel(nn.Linear(4, 2).to(DT))
        assert type(ddp._bucket_check) is BucketCheck
        scenario()


def _as_torch_makes_them(dtype, **ddp_kwargs):
    """The check's hook leaves DDP's gradients as torch's DDP makes them (many buckets, unused parameters, a static
    graph, 16-bit buckets, whose table holds 8-bit pieces), and still catches a mismatch. Bit for bit on 2 ranks; on
    more, the first bucket's all-reduce is longer by the table, so the ring adds some elements in another order:
    they may differ in the last bits, as they do between two of torch's bucket sizes."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).to(dtype)

    plain = nn.parallel.DistributedDataParallel(model(), **ddp_kwargs)
    ddp = dpfast.DistributedDataParallel(model(), **ddp_kwargs)
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(3)).to(dtype)
    for _ in range(3):
        plain.zero_grad()
        ddp.zero_grad()
        plain(x[4 * rank : 4 * (rank + 1)]).pow(2).sum().backward()
        ddp(x).pow(2).sum().backward()
        for (name, p), q in zip(plain.module.named_parameters(), ddp.module.parameters()):
            if world == 2:
                assert torch.equal(p.grad, q.grad), f"{name}: {(p.grad - q.grad).abs().max()}"
            else:
                ulps = 4 * torch.finfo(dtype).eps * p.grad.abs().max()
                assert (p.grad - q.grad).abs().max() <= ulps, f"{name}: {(p.grad - q.grad).abs().max()}"
    expect_batch_error(lambda: ddp(x[: 4 * world - rank]).sum().backward(), contains=("B differs across ranks",))


def _scenarios(world):
    out = {}
    for mode in ("global", "per_rank"):
        for gather in (False, True):
            name = f"no_more_collectives_than_torch_{mode}{'_gather' if gather else ''}"
            out[name] = functools.partial(_no_more_than_torch, lambda: nn.Linear(4, 3), gather, mode)
    out["no_more_collectives_than_torch_with_buffers"] = functools.partial(_no_more_than_torch, BNNet, False, "global")
    out["mismatch_later"] = functools.partial(_mismatch_later, False)
    out["mismatch_later_gather"] = functools.partial(_mismatch_later, True)
    for split in (False, True):
        out[f"same_jagged_tensors_agree_{'split' if split else 'replicated'}"] = functools.partial(
            _same_jagged_tensors_agree, split
        )
    for inputs in ("global", "per_rank"):
        for gather in (False, True):
            name = f"replicated_tensor_differs_{inputs}{'_gather' if gather else ''}"
            out[name] = functools.partial(_replicated_tensor_differs, gather, inputs)
    for gather in (False, True):
        for sync in (False, True):
            for no_grad in (False, True):
                name = f"bad_inputs_later{'_sync_bn' if sync else ''}{'_gather' if gather else ''}"
                name += "_no_grad" if no_grad else ""
                out[name] = functools.partial(_bad_inputs_later, functools.partial(WithTarget, sync), gather, no_grad)
    out["no_sync_chain"] = _no_sync_chain
    out["forward_counts_differ"] = _forward_counts_differ
    out["user_comm_hook"] = _user_comm_hook
    out["the_hook_in_use"] = _the_hook_in_use
    many = dict(bucket_cap_mb=0.0005)  # a bucket per layer or so: the first bucket is not the only one
    for name, dtype, kwargs in [
        ("many_buckets", DT, many),
        ("unused_parameters", DT, dict(many, find_unused_parameters=True)),
        ("static_graph", DT, dict(many, static_graph=True)),
        ("float16_buckets", torch.float16, many),
    ]:
        out[f"as_torch_makes_them_{name}"] = functools.partial(_as_torch_makes_them, dtype, **kwargs)
        out[f"as_torch_makes_them_{name}_python_hook"] = functools.partial(
            _on_the_python_hook, out[f"as_torch_makes_them_{name}"]
        )
    for name in ("mismatch_later", "no_sync_chain", "forward_counts_differ", "user_comm_hook"):
        out[f"{name}_python_hook"] = functools.partial(_on_the_python_hook, out[name])
    out["no_more_collectives_than_torch_python_hook"] = functools.partial(
        _on_the_python_hook, out["no_more_collectives_than_torch_global"]
    )
    out["bad_inputs_later_python_hook"] = functools.partial(_on_the_python_hook, out["bad_inputs_later"])
    return out


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
