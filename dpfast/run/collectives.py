"""Collectives a model calls inside ``forward``: ``all_gather``, ``all_reduce``, ``replica_index``, ``replica_count``.

One model code runs unchanged everywhere: inside a ``DataParallel`` call they work across that call's replicas
(through :mod:`dpfast.run.rendezvous`); under an initialized ``torch.distributed`` process group (e.g. inside
``dpfast.DistributedDataParallel``) across its ranks; otherwise they are the identity, replica 0 of 1.

All are differentiable. Across replicas the results are built with autograd ops from every replica's tensor, so
each replica's input receives the sum of every replica's gradient for it (for ``all_gather``: its slice of the
summed gradient). Every replica adds in the same order, so all replicas get bit-identical results.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from .rendezvous import Collective, current

REDUCE_OPS = ("sum", "mean", "max", "min")

__all__ = ["all_gather", "all_reduce", "replica_index", "replica_count"]


def _in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def replica_index() -> int:
    """This replica's index in the running ``DataParallel`` call, or this rank.

    Returns:
        The replica's index (0 for the first device's chunk) inside a ``DataParallel`` call; the rank under an
        initialized ``torch.distributed`` process group; 0 otherwise.

    Raises:
        Nothing: outside a call and a process group it is 0.
    """
    ctx = current()
    if ctx is not None:
        return ctx[1]
    return dist.get_rank() if _in_process_group() else 0


def replica_count() -> int:
    """How many replicas the running ``DataParallel`` call has, or the world size.

    Returns:
        The number of replicas that run this call (those with a chunk of the batch) inside a ``DataParallel`` call;
        the world size under an initialized ``torch.distributed`` process group; 1 otherwise.

    Raises:
        Nothing: outside a call and a process group it is 1.
    """
    ctx = current()
    if ctx is not None:
        return ctx[0].n
    return dist.get_world_size() if _in_process_group() else 1


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"dpfast.{name}: t must be a Tensor, got {type(t).__name__}")
    return t


def all_gather(t: Tensor, dim: int = 0) -> Tensor:
    """Every replica's ``t`` concatenated along ``dim``, in replica order; differentiable.

    Inside a ``DataParallel`` call it works across that call's replicas, under an initialized ``torch.distributed``
    process group across its ranks, and otherwise it returns ``t``. Backward gives each replica its slice of the
    sum of every replica's gradient of the result.

    Args:
        t: this replica's tensor; the replicas' tensors must agree in dtype and in every size but ``dim``'s.
        dim: the axis to concatenate along (negative counts from the end).

    Returns:
        The concatenation of every replica's ``t`` along ``dim`` (sizes along ``dim`` may differ per replica), the
        same bits on every replica, on ``t``'s device.

    Raises:
        TypeError: ``t`` is not a tensor, or ``dim`` is not an int.
        IndexError: ``dim`` is out of range for ``t`` (a 0-dim tensor has none: ``t.reshape(1)``).
        dpfast.CollectiveError: the replicas' tensors do not fit together, a replica called another collective
            (or none) at this point, or another replica failed before reaching it.
    """
    t = _check_tensor("all_gather", t)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dpfast.all_gather: dim must be an int, got {type(dim).__name__} {dim!r}")
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise IndexError(
            f"dpfast.all_gather: dim {dim} is out of range for a tensor of shape {tuple(t.shape)}; gather along "
            "one of its dims (a 0-dim tensor: t.reshape(1))"
        )
    dim %= t.dim()
    gather = functools.partial(ops.gather, dim=dim, device=t.device)
    return _collective("all_gather", dim, t, gather, lambda: _DistAllGather.apply(t, dim))


def all_reduce(t: Tensor, op: str = "sum") -> Tensor:
    """Every replica's ``t`` combined by ``op``; every replica gets the result; differentiable.

    Inside a ``DataParallel`` call it works across that call's replicas, under an initialized ``torch.distributed``
    process group across its ranks, and otherwise it returns ``t``. The replicas' values are added in replica order,
    so every replica gets the same bits.

    Args:
        t: this replica's tensor; every replica's must have the same shape and dtype.
        op: ``"sum"``, ``"mean"`` (each replica counts once, whatever its share of the batch), ``"max"`` or
            ``"min"``.

    Returns:
        The combined tensor, with ``t``'s shape, on ``t``'s device.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: ``op`` is not one of the four.
        dpfast.CollectiveError: the replicas' tensors do not fit together, a replica called another collective
            (or none) at this point, or another replica failed before reaching it.
    """
    t = _check_tensor("all_reduce", t)
    if op not in REDUCE_OPS:
        raise ValueError(f"dpfast.all_reduce: op is {op!r}; use one of {', '.join(map(repr, REDUCE_OPS))}")
    return _collective(
        "all_reduce", op, t, lambda values: _reduce_deposits([v.to(t.device) for v in values], op),
        lambda: _DistAllReduce.apply(t, op),
    )  # fmt: skip


def _collective(kind: str, arg: Any, t: Tensor, combine: Callable[[list], Tensor], across_ranks: Callable) -> Tensor:
    """A collective inside a DataParallel call (every replica's deposit, combined), across a process group's ranks,
    or (neither) ``t`` itself."""
    ctx = current()
    if ctx is not None:
        call, i = ctx
        if call.n == 1:
            return t
        coll = call.enter(i, (kind, arg), _deposit(t))
        return combine([coll.values[j] for j in range(call.n)])
    if _in_process_group():
        return _through_observer(kind, t, arg, across_ranks)
    _warn_if_recomputing(kind)
    return t


# ---- observing the process-group collectives of a block (dpfast.DistributedDataParallel's forward) ------------

# (kind, t, arg, communicate) -> the collective's result: call communicate() to run it, or return a stand-in
Observer = Callable[[str, Tensor, object, Callable[[], Tensor]], Tensor]
_OBSERVER: contextvars.ContextVar[Observer | None] = contextvars.ContextVar("dpfast_collective_observer", default=None)


class observe_process_group_collectives:
    """Within the block, every ``all_gather``/``all_reduce`` across a process group goes through ``observer``:
    ``observer(kind, t, arg, communicate)`` (``kind`` is ``"all_gather"`` or ``"all_reduce"``, ``arg`` the dim or
    op) returns the result, by calling ``communicate()`` or instead of it. DistributedDataParallel counts them, and
    replays them for a rank that must keep step with the others without running its module. (A class, not a
    generator: it wraps every DistributedDataParallel forward.)"""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def __enter__(self) -> None:
        self.token = observing(self.observer)

    def __exit__(self, *exc: object) -> None:
        _OBSERVER.reset(self.token)


def observing(observer: Observer) -> contextvars.Token:
    """Make ``observer`` the one the process-group collectives go through; reset with the token it returns."""
    return _OBSERVER.set(observer)


def _through_observer(kind: str, t: Tensor, arg: object, communicate: Callable[[], Tensor]) -> Tensor:
    observer = _OBSERVER.get()
    return communicate() if observer is None else observer(kind, t, arg, communicate)


def _deposit(t: Tensor) -> Tensor:
    """What a replica hands to the others: a copy (differentiable), so that changing ``t`` in place once it has its
    turn back cannot change what replicas that read later receive (real devices hand finished copies too)."""
    return t.clone()


_warned_recompute = False


def _warn_if_recomputing(name: str) -> None:
    """A collective called in backward, outside any call and process group, is most likely a
    torch.utils.checkpoint recomputation of a region that ran inside a DataParallel call: there it is the identity,
    which is wrong. Say so, once."""
    global _warned_recompute
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    if _warned_recompute or graph_task is None or graph_task() == -1:
        return
    _warned_recompute = True
    warnings.warn(
        f"dpfast.{name} was called during backward outside a DataParallel call, where it is the identity: if this "
        "is a torch.utils.checkpoint recomputation of a region that ran under DataParallel with several replicas, "
        "its result differs from the forward's. Collectives inside checkpointed regions are not supported: "
        "checkpoint the parts between collectives instead (said once)",
        RuntimeWarning,
        stacklevel=3,
    )


def _reduce_deposits(values: Sequence[Tensor], op: str) -> Tensor:
    """The replicas' deposits combined by ``op``, added in replica order (so every replica gets the same bits)."""
    if op in ("max", "min"):
        stacked = torch.stack(list(values))
        return stacked.amax(0) if op == "max" else stacked.amin(0)
    out = values[0]
    for v in values[1:]:
        out = out + v
    return out / len(values) if op == "mean" else out


def check_collective(coll: Collective, devices: Sequence[torch.device]) -> str | None:
    """Whether the replicas' deposits fit together (checked once, when all have arrived): an error or None."""
    values = [coll.values[j] for j in range(len(devices))]
    ref = values[0]
    name, arg = coll.what
    for j, v in enumerate(values):
        if v.dtype != ref.dtype or v.dim() != ref.dim():
            return (
                f"replica {j} gave a {v.dtype} tensor of shape {tuple(v.shape)}, replica 0 a {ref.dtype} one of "
                f"shape {tuple(ref.shape)}; every replica must give the same dtype and number of dims"
            )
        other = [k for k in range(v.dim()) if v.shape[k] != ref.shape[k] and not (name == "all_gather" and k == arg)]
        if other:
            allowed = f"; only dim {arg} may differ" if name == "all_gather" else ""
            return (
                f"replica {j} gave shape {tuple(v.shape)}, replica 0 shape {tuple(ref.shape)}: they differ in dim "
                f"{other[0]}{allowed}"
            )
    return None


# ---- across the ranks of a process group ---------------------------------------------------------------------


class _DistAllGather(torch.autograd.Function):
    """All-gather with any size along ``dim`` per rank; backward: the sum over ranks of the output gradients,
    this rank's slice of it (the adjoint)."""

    @staticmethod
    def forward(ctx, t: Tensor, dim: int) -> Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        size = torch.tensor([t.shape[dim]], dtype=torch.int64, device=t.device)
        sizes = [torch.empty_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        rows = [int(s.item()) for s in sizes]
        widest = max(rows)
        moved = t.movedim(dim, 0).contiguous()
        padded = moved.new_zeros((widest,) + tuple(moved.shape[1:]))
        padded[: rows[rank]] = moved
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        ctx.dim, ctx.rows, ctx.rank = dim, rows, rank
        return torch.cat([p[:r] for p, r in zip(parts, rows)], 0).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad.contiguous().clone()
        dist.all_reduce(g)
        start = sum(ctx.rows[: ctx.rank])
        return g.narrow(ctx.dim, start, ctx.rows[ctx.rank]), None


class _DistAllReduce(torch.autograd.Function):
    """All-reduce; backward: every rank's output depends on every rank's input, so the gradient is the sum over
    ranks of the output gradients (over the world size for "mean"; only where this rank held the extremum, shared
    between ties, for "max"/"min")."""

    @staticmethod
    def forward(ctx, t: Tensor, op: str) -> Tensor:
        out = t.detach().clone()
        red = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}.get(op, dist.ReduceOp.MIN)
        dist.all_reduce(out, op=red)
        ctx.op, ctx.world = op, dist.get_world_size()
        if op == "mean":
            out = out / ctx.world
        if op in ("max", "min"):
            ctx.save_for_backward((t == out).to(t.dtype))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad.contiguous().clone()
        dist.all_reduce(g)
        if ctx.op == "mean":
            return g / ctx.world, None
        if ctx.op in ("max", "min"):
            (hit,) = ctx.saved_tensors
            ties = hit.clone()
            dist.all_reduce(ties)
            return g * hit / ties.clamp_min(1), None
        return g, None
