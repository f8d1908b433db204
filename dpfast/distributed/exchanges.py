"""The differentiable exchanges of ``DistributedDataParallel``: the gathered outputs (``gather_outputs=True``) and
the gradients of the call's inputs.

:class:`Exchange` assembles the outputs from every rank's contribution (all-gathered as bytes by
:mod:`dpfast.distributed.outputs`); its backward sums this rank's part of every rank's output gradients (one
all-to-all per dtype), the exact adjoint, so a loss on the gathered outputs gives the full-batch gradient after
DDP's averaging (see :mod:`dpfast.distributed.module`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:  # (output_layout imports this module)
    from .output_layout import OutputLayout


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """The process group a DDP module talks over, and the device its collectives' buffers live on."""

    process_group: Any
    rank: int
    world: int
    comm_device: torch.device


class ZeroOut(torch.autograd.Function):
    """Zeros shaped like the input, with a zero gradient: keeps a ghost's graph connected while contributing 0."""

    @staticmethod
    def forward(ctx, x):
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


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
class GatheredOutputs:
    """One exchange of outputs as every rank knows it once the bytes are gathered: the outputs' layout (per tensor
    its kind, ``"cat"`` or ``"red"``, axis, this rank's local shape, dtype and device; see
    :class:`~dpfast.distributed.output_layout.OutputLayout`), every rank's rows of each "cat" tensor, every rank's
    weight in a "red" one, and per tensor the ranks' parts of the gathered bytes: a "cat" tensor's rows
    along axis 0, in rank order, of the ranks that sent some; a "red" tensor's contribution of every rank."""

    group: RankGroup
    layout: OutputLayout
    rows: list[tuple[int, ...]]  # per rank: its rows of each "cat" tensor
    weights: list[float]  # per rank: its factor in a "mean" (its share)
    sum_weights: list[float]  # per rank: its factor in a "sum" (1 or 0)
    parts: list[list[Tensor]]
    formats: dict[int, torch.memory_format] = dataclasses.field(default_factory=dict)  # the channels_last ones

    def assemble(self) -> list[Tensor]:
        """The full-batch outputs: "cat" tensors concatenated in rank order, "red" ones summed in rank order; each
        a tensor of its own (no view of the gathered bytes), so that it may be modified in place; channels_last
        where ``formats`` says (the ranks agreed on it), else contiguous."""
        lay, outs = self.layout, []
        for i, kind in enumerate(lay.kinds):
            parts, shape, device = self.parts[i], lay.shapes[i], lay.devices[i]
            if kind == "cat":
                if len(parts) == 1:
                    full = parts[0]
                elif parts:
                    full = torch.cat(parts, 0)
                else:
                    full = torch.empty((0, *row_shape(shape, lay.axes[i])), dtype=lay.dtypes[i])
                full = full.to(device)
                if shape and lay.axes[i]:
                    full = full.movedim(0, lay.axes[i])
                full = _in_format(full, self.formats.get(i))
                outs.append(full.clone() if full._is_view() else full)  # (0-dim: stacked)
                continue
            w = self.weights if lay.reductions[i] == "mean" else self.sum_weights
            total = None
            for r, part in enumerate(parts):
                if w[r]:
                    term = part if w[r] == 1 else part * w[r]
                    total = term if total is None else total + term
            if total is None:
                total = torch.zeros(shape, dtype=lay.dtypes[i])
            total = _in_format(total.to(device), self.formats.get(i))
            outs.append(total.clone() if total._is_view() else total)
        return outs

    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """The adjoint: every rank's output gradients summed over ranks, each rank getting only its own part. One
        all-to-all per dtype: rank ``j`` is sent every rank's gradient of ``j``'s rows of each "cat" tensor, and of
        each "red" tensor whole, and sums what it gets in rank order (an all-reduce would sum every row on every
        rank; on gloo it costs several times an all-to-all, benchmarks/RESULTS.md)."""
        out: list[Tensor | None] = [None] * len(grads)
        g, world = self.group, self.group.world
        for idx in self.layout.grad_groups():
            send, in_splits, own = self._send(idx, grads)
            dtype, mine = self.layout.dtypes[idx[0]], sum(own)
            if sum(in_splits):  # (the same total on every rank: every rank's rows are known to all)
                recv = torch.empty(world * mine, dtype=dtype, device=g.comm_device)
                item = send.element_size()  # sent as bytes: any dtype, complex included
                dist.all_to_all_single(
                    recv.view(torch.uint8),
                    send.view(torch.uint8),
                    [mine * item] * world,
                    [n * item for n in in_splits],
                    group=g.process_group,
                )
                summed = recv if world == 1 else recv.view(world, mine).sum(0)
            else:
                summed = torch.zeros(0, dtype=dtype, device=g.comm_device)
            o = 0
            for i, n in zip(idx, own):
                out[i] = self._own_part(i, summed[o : o + n])
                o += n
        return out

    def _send(self, idx: list[int], grads: Sequence[Tensor]) -> tuple[Tensor, list[int], list[int]]:
        """What this rank sends of the gradients of outputs ``idx`` (one dtype), flat, on the collectives' device,
        in order of destination rank; how many elements each rank is sent; per output, how many of the elements
        each rank sends this one are its."""
        g = self.group
        sends: list[list[Tensor]] = [[] for _ in range(g.world)]
        own = []
        for i in idx:
            pieces = self._pieces(i, grads[i])
            for j, piece in enumerate(pieces):
                sends[j].append(piece)
            own.append(pieces[g.rank].numel())
        in_splits = [sum(p.numel() for p in per) for per in sends]
        pieces = [p for per in sends for p in per]
        if any(self.layout.devices[i] != g.comm_device for i in idx):
            pieces = [p.to(g.comm_device) for p in pieces]
        return (pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)), in_splits, own

    def _rows(self, i: int) -> list[int]:
        """Every rank's rows of "cat" tensor ``i`` (0 for a rank whose outputs do not count)."""
        j = self.layout.kinds[:i].count("cat")  # its place among the "cat" tensors
        return [mine[j] for mine in self.rows]

    def _pieces(self, i: int, grad: Tensor) -> list[Tensor]:
        """Per rank, what it needs of this rank's gradient of gathered output ``i``, flat: its rows ("cat"), or the
        whole of it ("red")."""
        if self.layout.kinds[i] == "red":
            return [grad.reshape(-1)] * self.group.world
        rows_first = self._rows_first(i, grad)
        pieces, start = [], 0
        for n in self._rows(i):
            pieces.append(rows_first[start : start + n].reshape(-1))
            start += n
        return pieces

    def _rows_first(self, i: int, grad: Tensor) -> Tensor:
        """The gradient of gathered output ``i`` with its rows along axis 0 ("cat"; a 0-dim output is stacked
        already), or as it is ("red")."""
        axis = self.layout.axes[i]
        return grad.movedim(axis, 0) if axis and self.layout.kinds[i] == "cat" and self.layout.shapes[i] else grad

    def _own_part(self, i: int, summed: Tensor) -> Tensor:
        """This rank's gradient of its output ``i`` from ``summed`` (its part of every rank's gradient of the
        gathered output, summed, flat)."""
        lay = self.layout
        dtype, device, shape = lay.dtypes[i], lay.devices[i], lay.shapes[i]
        r = self.group.rank
        if lay.kinds[i] == "red":
            w = (self.weights if lay.reductions[i] == "mean" else self.sum_weights)[r]
            return torch.zeros(shape, dtype=dtype, device=device) if w == 0 else summed.view(shape).to(device) * w
        n_rows = self._rows(i)[r]
        if len(shape) == 0:  # a 0-dim output, stacked: this rank's entry (if it counted)
            return summed.view(()).to(device) if n_rows else torch.zeros((), dtype=dtype, device=device)
        axis = lay.axes[i]
        if n_rows != shape[axis]:  # a rank whose outputs do not count (a ghost, or not rank 0 when nothing split)
            return torch.zeros(shape, dtype=dtype, device=device)
        mine = summed.view((n_rows, *row_shape(shape, axis)))
        mine = mine.movedim(0, axis) if axis else mine
        return mine if device == self.group.comm_device else mine.to(device)


def _in_format(t: Tensor, memory_format: torch.memory_format | None) -> Tensor:
    """``t`` contiguous, or a channels_last copy of it with the strides torch gives one (also where both formats
    would do, as for 1x1 pixels, whose strides only ``empty(..., memory_format=)`` sets)."""
    if memory_format is None:
        return t.contiguous()
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=memory_format).copy_(t)


def row_shape(shape: tuple, axis: int) -> tuple:
    """A "cat" tensor's shape without its gathered axis (a 0-dim tensor gathers as one row of shape ())."""
    return tuple(n for k, n in enumerate(shape) if k != axis) if shape else ()


class Exchange(torch.autograd.Function):
    """Forward: the gathered outputs (already communicated; this rank's tensors only connect the graph).
    Backward: the adjoint (:meth:`GatheredOutputs.backward`), at one point of every rank's backward pass."""

    @staticmethod
    def forward(ctx, gathered: GatheredOutputs, *tensors):
        ctx.gathered = gathered
        outs = gathered.assemble()
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(ctx.gathered.backward(grads))
