"""The input side of ``DistributedDataParallel``: a rank's share of a call, the same contiguous split ``DataParallel``
makes over devices, made over ranks, by the call's program (:func:`take_rows`, :func:`rank_call`); the gradients of
the call's inputs (:func:`through_input_grads`); and the public helpers for per-rank loading that cut as the
wrapper cuts (:func:`shard_batch`, :func:`shard_range`, :func:`shard_dataset`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import ops
from ..move.nested import scatter_jagged
from ..move.scatter import scatter_packed
from ..plan.call_plan import CallPlan, plan_call
from ..plan.costs import CostSource
from ..plan.errors import ScatterError
from ..plan.splits import split_sizes
from ..trees.binding import Binding, BoundArguments
from ..trees.containers import packed_batch
from ..trees.specs import Spec, validate_spec
from .empty_ranks import EmptyShare
from .group import RankGroup, rank_weights, rank_world


class Share(NamedTuple):
    """This rank's part of one global batch, as ``DistributedDataParallel.share`` holds it after a forward.

    Attributes:
        rank: this rank.
        world_size: the number of ranks.
        batch_size: ``B``, the global batch's size (``None``: nothing was split).
        sizes: the rows of every rank, in rank order (``()`` when nothing was split).
        start: this rank's first row of the global batch.
        stop: one past its last row: its rows are ``start:stop``.
    """

    rank: int
    world_size: int
    batch_size: int | None
    sizes: tuple  # rows per rank; () when nothing is split
    start: int
    stop: int

    @property
    def size(self) -> int:
        """This rank's number of rows, ``stop - start``."""
        return self.stop - self.start


def take_rows(tree: BoundArguments, start: int, length: int, subs: dict | None = None) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` with every leaf its program splits cut to rows ``start:start+length``.

    Tensors are narrowed (a view when the axis is 0, else made contiguous); PackedSequences are split by sequence in
    the caller's order with the code ``DataParallel`` uses. Everything else, spec ``None`` included, is passed as
    given. ``subs`` maps a leaf (by its position among the call's leaves) to the value to use instead (DDP: the
    input seen through the node that averages input gradients).
    """
    program = tree.program
    values = list(tree.flat)
    for i, v in (subs or {}).items():
        values[i] = v
    if program.only_tensors:  # every split leaf a plain tensor: cut in one call into the extension, when it can
        cut = ops._narrow_many([values[i] for i in program.mapped], program.axes, start, length)
        if cut is not None:
            for i, v in zip(program.mapped, cut):
                values[i] = v
            return tree.rebuild(values)
    for i, kind, axis in zip(program.mapped, program.kinds, program.axes):
        value = values[i]
        if kind == "items":
            values[i] = value[start : start + length]
        elif kind in ("packed", "jagged"):
            values[i] = _cut_whole(tree, i, value, kind, start, length)
        else:
            values[i] = _narrowed(value, axis, start, length)
    return tree.rebuild(values)


def _cut_whole(tree: BoundArguments, i: int, value: Any, kind: str, start: int, length: int) -> Any:
    """Rows ``start:start+length`` of a PackedSequence or a jagged nested tensor: the other ranks' rows as (at most)
    two chunks, never an empty one (neither can hold zero samples), so empty shares elsewhere and the ghost work."""
    if length == 0:
        what = (
            "a PackedSequence, which cannot hold zero sequences"
            if kind == "packed"
            else ("a jagged nested tensor, which cannot hold zero samples")
        )
        raise ValueError(f"`{tree.leaves[i].path}` is {what}")
    total = packed_batch(value) if kind == "packed" else value.shape[0]
    parts = [n for n in (start, length, total - start - length) if n]
    device = value.data.device if kind == "packed" else value.device
    cut = scatter_packed if kind == "packed" else scatter_jagged
    return cut(value, parts, [device] * len(parts))[1 if start else 0]


def cut_rows(plan: CallPlan, start: int, length: int, subs: dict | None = None) -> tuple[tuple, dict]:
    """:func:`take_rows` of a planned call."""
    return take_rows(plan.tree, start, length, subs)


def _with(tree: BoundArguments, subs: dict) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` as given, but for ``subs``."""
    values = list(tree.flat)
    for i, v in subs.items():
        values[i] = v
    return tree.rebuild(values)


def _narrowed(t: torch.Tensor, axis: int, start: int, length: int) -> torch.Tensor:
    """Rows ``start:start+length`` of ``t`` along ``axis``: a view along axis 0, else a contiguous copy."""
    v = t.narrow(axis, start, length)
    return v if axis == 0 else v.contiguous()


class ScaleGrad(torch.autograd.Function):
    """Identity on the call's tensor inputs that require grad; backward scales their gradients by ``factor``.

    A rank differentiates only through its own rows. With per-rank inputs (or without ``gather_outputs``) each
    rank keeps its own rows' gradient, scaled by ``1 / W`` as DDP's average scales the parameters', so it is the
    full-batch gradient of those rows in the cases where the parameters' is (see the module docstring)."""

    @staticmethod
    def forward(ctx, factor, *tensors):
        ctx.factor = factor
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(None if g is None else g * ctx.factor for g in grads)


class AverageInputGrads(torch.autograd.Function):
    """Identity on the call's tensor inputs that require grad; backward averages their gradients over ranks.

    With ``gather_outputs`` and the global batch on every rank, rank ``r``'s gradient w.r.t. a global-batch input
    holds ``W`` times the full-batch gradient on its own rows and zeros elsewhere; averaging (one all-reduce for
    all inputs, before they are sliced, so shapes agree) gives every rank the full-batch gradient of every row.
    Its all-reduce runs in backward, after the ranks checked their batches in the output exchange."""

    @staticmethod
    def forward(ctx, group, world, comm_device, *tensors):
        ctx.group, ctx.world, ctx.comm_device = group, world, comm_device
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        out: list = [None] * len(grads)
        by_dtype: dict = {}
        for i, (_, dtype, _) in enumerate(ctx.meta):
            by_dtype.setdefault(dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            flat = [
                (grads[i] if grads[i] is not None else torch.zeros(ctx.meta[i][0], dtype=dtype))
                .reshape(-1)
                .to(ctx.comm_device)
                for i in idx
            ]
            buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            if buf.numel():
                dist.all_reduce(buf, group=ctx.group)
            buf /= ctx.world
            o = 0
            for i in idx:
                shape, _, device = ctx.meta[i]
                n = math.prod(shape)
                out[i] = buf[o : o + n].view(shape).to(device)
                o += n
        return (None, None, None) + tuple(out)


def through_input_grads(tree: Any, group: RankGroup, average: bool) -> dict:
    """The call's tensor inputs that require grad, seen through one node that averages (``average``: the global
    batch with ``gather_outputs``) or scales their gradients; maps each such leaf (by its position among the call's
    leaves) to its view.

    Only leaf tensors are scaled: the gradient of an input computed by an earlier call (a recurrent state fed back)
    flows on into that call's graph, where DDP's averaging already accounts for it."""
    grad, flat = tree.program.grad, tree.flat  # (the program knows which require grad)
    where = [i for i in grad if average or flat[i].is_leaf] if grad else grad
    if not where:
        return {}
    values = [flat[i] for i in where]
    if average:
        views = AverageInputGrads.apply(group.process_group, group.world, group.comm_device, *values)
    else:
        views = ScaleGrad.apply(1.0 / group.world, *values)
    return dict(zip(where, views))


@dataclasses.dataclass
class RankCall:
    """This rank's part of one planned call: the arguments it runs, its :class:`Share` (``None`` while every
    rank's rows are not known yet: per-rank inputs, where ``pending_rows`` holds this rank's), and how it runs when
    it has no rows (``empty``)."""

    args: tuple
    kwargs: dict
    share: Share | None
    pending_rows: int | None = None
    empty: EmptyShare | None = None


def plan_rank_call(
    specs: Binding, inputs: tuple, kwargs: dict, parts: int, weights: Any, cost: CostSource | None
) -> tuple[CallPlan | None, BaseException | None]:
    """The call planned over ``parts`` ranks (1 for per-rank inputs), or why it cannot be: one rank may fail
    alone, and it still keeps step with the others (its check row says why)."""
    try:
        return plan_call(specs, inputs, kwargs, parts, weights, cost=cost), None
    except (ScatterError, TypeError, ValueError) as exc:
        return None, exc


def rank_call(
    plan: CallPlan,
    inputs: tuple,
    kwargs: dict,
    rank: int,
    world: int,
    per_rank: bool,
    subs: dict,
    move: Callable[[tuple, dict], tuple[tuple, dict]],
) -> RankCall:
    """Rank ``rank``'s part of ``plan``: its rows of the global batch, or (``per_rank``) the inputs as given.
    ``subs`` replaces inputs by their views for the input-gradient node; ``move`` puts a ghost on the device."""
    if per_rank:
        args, kw = _with(plan.tree, subs) if subs else (inputs, kwargs)
        rows = plan.batch_size
        if rows is None:  # nothing to split on any rank (the ranks check it): as with the global batch
            return RankCall(args, kw, Share(rank, world, None, (), 0, 0))
        return RankCall(args, kw, None, rows, EmptyShare((args, kw), None) if rows == 0 else None)
    if plan.mode != "split":  # nothing to split, or B == 0: every rank runs the whole input; rank 0's counts
        args, kw = _with(plan.tree, subs) if subs else (inputs, kwargs)
        return RankCall(args, kw, Share(rank, world, plan.batch_size, (), 0, plan.batch_size or 0))
    share = _share_of(rank, world, plan.batch_size, tuple(plan.sizes))
    start, stop = share.start, share.stop
    if stop > start:
        return RankCall(*take_rows(plan.tree, start, stop - start, subs), share)
    try:
        empty = cut_rows(plan, start, 0, subs)
    except ValueError:  # a PackedSequence or jagged tensor cannot hold zero samples: straight to the ghost
        empty = None
    ghost = EmptyShare(empty, lambda: move(*cut_rows(plan, 0, 1, subs)))
    return RankCall(*(empty or (inputs, kwargs)), share, None, ghost)


def per_rank_share(rank: int, rows: Sequence[int]) -> Share:
    """Rank ``rank``'s :class:`Share` when every rank passed its own ``rows[r]`` rows (per-rank inputs)."""
    start = sum(rows[:rank])
    return Share(rank, len(rows), sum(rows), tuple(rows), start, start + rows[rank])


@functools.lru_cache(maxsize=256)
def _share_of(rank: int, world: int, batch: int, sizes: tuple[int, ...]) -> Share:
    """Rank ``rank``'s :class:`Share` of ``sizes`` (remembered: a training loop splits the same way every step)."""
    start = sum(sizes[:rank])
    return Share(rank, world, batch, sizes, start, start + sizes[rank])


def shard_range(
    n: int,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    chunk_sizes: Sequence[float] | None = None,
) -> range:
    """The indices of ``n`` items that ``rank`` owns: the contiguous, as-even-as-possible split that
    :class:`DistributedDataParallel` and ``DataParallel`` make.

    Args:
        n: the number of items (samples of a dataset, rows of a batch).
        rank: this rank (default: the initialized process group's).
        world_size: the number of ranks (default: the initialized process group's).
        chunk_sizes: relative weights per rank, as ``DataParallel``'s (0 gives a rank nothing).

    Returns:
        ``range(start, stop)``: earlier ranks take the remainder. Nothing is dropped or repeated: the ranges of all
        ranks partition ``range(n)``.

    Raises:
        ValueError: ``rank``/``world_size`` out of range, or not given without an initialized process group; bad
            ``chunk_sizes`` (another count than ranks, a negative weight).
    """
    rank, world_size = rank_world(rank, world_size)
    sizes = split_sizes(n, world_size, rank_weights(chunk_sizes, world_size))
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def shard_dataset(
    dataset,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    chunk_sizes: Sequence[float] | None = None,
) -> torch.utils.data.Subset:
    """``rank``'s contiguous share of a map-style dataset, for per-rank loading.

    Every rank must still run the same number of steps (DDP's gradient all-reduce is a collective), so with uneven
    shares use equal step counts, or ``torch.utils.data.DistributedSampler`` (which pads by repeating samples).

    Args:
        dataset: a map-style dataset (``len()`` and indexing).
        rank: this rank (default: the initialized process group's).
        world_size: the number of ranks (default: the initialized process group's).
        chunk_sizes: relative weights per rank, as ``DataParallel``'s.

    Returns:
        A ``torch.utils.data.Subset`` of the indices :func:`shard_range` gives this rank.

    Raises:
        ValueError: as :func:`shard_range`.
        TypeError: ``dataset`` has no ``len()``.
    """
    return torch.utils.data.Subset(dataset, list(shard_range(len(dataset), rank, world_size, chunk_sizes=chunk_sizes)))


def _one_batch(batch):  # the signature shard_batch binds its in_dims to
    return batch


def shard_batch(
    batch: Any,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    in_dims: Spec = None,
    dim: int = 0,
    chunk_sizes: Sequence[float] | None = None,
    cost: Any = None,
) -> Any:
    """``rank``'s share of one global batch, cut exactly as :class:`DistributedDataParallel` cuts its inputs.

    Args:
        batch: a tensor, or any tuple/list/dict/namedtuple/dataclass tree of them.
        rank: this rank (default: the initialized process group's).
        world_size: the number of ranks (default: the initialized process group's).
        in_dims: a spec prefix of ``batch``, as ``DataParallel``'s (default ``dim`` everywhere; ``None`` leaves keep
            tensors whole).
        dim: the batch axis of every tensor ``in_dims`` does not name.
        chunk_sizes: relative weights per rank, as ``DataParallel``'s.
        cost: balances per-sample costs as ``DataParallel``'s does: a path rooted at ``batch``
            (``"batch['lengths']"``) or a callable taking ``batch``.

    Returns:
        ``batch`` with every mapped tensor cut to this rank's rows (empty slices for a rank with none); ``batch``
        itself when nothing is split (no tensor with an int spec).

    Raises:
        dpfast.ScatterError: the mapped tensors disagree on the batch size, as in ``DataParallel``.
        TypeError, ValueError: a spec that does not match ``batch``, bad costs, ``rank``/``world_size`` out of
            range or missing without a process group, bad ``chunk_sizes``.
    """
    rank, world_size = rank_world(rank, world_size)
    weights = rank_weights(chunk_sizes, world_size)
    if in_dims is not None:
        validate_spec(in_dims, "in_dims", allow_reductions=False)
    specs = Binding(_one_batch, None if in_dims is None else {"batch": in_dims}, dim)
    cost_spec = None if cost is None else CostSource(cost, specs)
    plan = plan_call(specs, (batch,), {}, world_size, weights, cost=cost_spec)
    if plan.batch_size is None:
        return batch
    start, stop = plan.share(rank)
    args, _ = cut_rows(plan, start, stop - start)
    return args[0]
