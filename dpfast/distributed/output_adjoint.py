"""The gathered outputs of ``gather_outputs=True`` and their adjoint.

:class:`Exchange` assembles the outputs from every rank's contribution (all-gathered as bytes by
:mod:`dpfast.distributed.outputs`); its backward sums this rank's part of every rank's output gradients (one
all-to-all per dtype), the exact adjoint.

Gradient math: rank ``r`` computes ``o_r = f(x_r; θ)``; the gather gives every rank ``O = [o_0, ..., o_{W-1}]`` and
every rank computes the same loss ``L(O)`` and calls ``backward``. The backward of the gather is the exact adjoint of
an all-gather in the global graph: the output gradients of **all** ranks are summed and rank ``r`` keeps its slice,
``W · ∂L/∂o_r`` (for ``"mean"``/``"sum"`` outputs, ``c_r · W · ∂L/∂v`` with ``c_r`` the rank's weight). Rank
``r``'s parameter gradient is ``W · J_rᵀ ∂L/∂o_r``, and DDP's all-reduce *averages*: ``(1/W) Σ_r W · J_rᵀ ∂L/∂o_r =
∂L/∂θ``, exactly the single-process full-batch gradient, with the global batch or per-rank inputs alike. Every rank
must use the gathered outputs the same way and call ``backward``: the gather's backward is a collective. (The
gradients of the call's inputs: :func:`~dpfast.distributed.inputs.through_input_grads`.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .group import RankGroup
from .output_layout import OutputLayout, row_shape


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
