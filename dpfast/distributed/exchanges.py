"""The differentiable collectives behind ``DistributedDataParallel(gather_outputs=True)``.

:class:`Exchange` all-gathers the "cat" outputs (any row count per rank) and all-reduces the weighted "red" ones;
its backward all-reduces every rank's output gradients and keeps this rank's part, the exact adjoint, so a loss on
the gathered outputs gives the full-batch gradient after DDP's averaging (see :mod:`dpfast.distributed.module`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


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


class Exchange(torch.autograd.Function):
    """Forward: all-gather the "cat" tensors (variable rows per rank) and all-reduce the weighted "red" tensors.
    Backward: all-reduce the output gradients of every rank (the adjoint of both) and keep this rank's part.

    One node for all outputs, so its backward issues its collectives at one point of every rank's backward pass.
    """

    @staticmethod
    def forward(ctx, exchange, *tensors):
        ctx.exchange = exchange
        outs = exchange.forward(tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(ctx.exchange.backward(grads))


class AverageInputGrads(torch.autograd.Function):
    """Identity on the call's tensor inputs that require grad; backward averages their gradients over ranks.

    Rank ``r`` only differentiates through its own rows, so its gradient w.r.t. a global-batch input is partial;
    averaging (one all-reduce for all inputs, before they are sliced, so shapes agree) gives every rank the same
    gradient DDP gives the parameters: with ``gather_outputs`` the full-batch one (each rank's share carries the
    factor ``W``, see the module docstring), without it the mean over ranks of their local gradients.
    """

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


class OutputExchange:
    """One exchange of outputs across ranks, as every rank knows it: per tensor its kind, axis, per-rank rows and
    this rank's weight. ``forward`` all-gathers and all-reduces, ``backward`` is its adjoint."""

    def __init__(self, group, comm_device, rank, world, kinds, axes, rows, weights, shapes, dtypes, devices):
        self.group = group
        self.comm_device = comm_device
        self.rank = rank
        self.world = world
        self.kinds = kinds  # "cat" | "red" per tensor
        self.axes = axes  # axis for "cat" (0 for 0-dim, after unsqueeze)
        self.rows = rows  # per "cat" tensor: rows along the axis per rank (0 for inactive ranks)
        self.weights = weights  # per "red" tensor: this rank's factor c_r
        self.shapes = shapes  # local shapes
        self.dtypes = dtypes
        self.devices = devices

    # forward ------------------------------------------------------------------------------------------------
    def forward(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        outs: list[Tensor | None] = [None] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            cat = [i for i in idx if self.kinds[i] == "cat"]
            red = [i for i in idx if self.kinds[i] == "red"]
            if cat:
                self._gather(tensors, cat, dtype, outs)
            if red:
                self._reduce(tensors, red, dtype, outs)
        return outs  # type: ignore[return-value]

    def _moved(self, t: Tensor, i: int) -> Tensor:
        """A "cat" tensor with its axis first (a 0-dim tensor becomes one row)."""
        return t.reshape(1) if t.dim() == 0 else t.movedim(self.axes[i], 0)

    def _gather(self, tensors, cat, dtype, outs) -> None:
        # per rank r, the flat numel of each leaf: rows[r] * (numel of one row)
        row_numel = {}
        for i in cat:
            m = self._moved(tensors[i], i)
            row_numel[i] = math.prod(m.shape[1:])
        per_rank = [sum(self.rows[i][r] * row_numel[i] for i in cat) for r in range(self.world)]
        width = max(per_rank)
        mine = [self._moved(tensors[i], i).reshape(-1)[: self.rows[i][self.rank] * row_numel[i]] for i in cat]
        buf = torch.zeros(width, dtype=dtype, device=self.comm_device)
        if per_rank[self.rank]:
            buf[: per_rank[self.rank]] = torch.cat([m.to(self.comm_device) for m in mine])
        if width:
            bufs = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(bufs, buf, group=self.group)
        else:
            bufs = [buf] * self.world
        offs = [0] * self.world
        for i in cat:
            m = self._moved(tensors[i], i)
            pieces = []
            for r in range(self.world):
                n = self.rows[i][r] * row_numel[i]
                if self.rows[i][r]:
                    pieces.append(bufs[r][offs[r] : offs[r] + n].view((self.rows[i][r],) + tuple(m.shape[1:])))
                offs[r] += n
            full = torch.cat(pieces, 0) if pieces else m.new_empty((0,) + tuple(m.shape[1:]))
            full = full.to(self.devices[i])
            outs[i] = full if tensors[i].dim() == 0 else full.movedim(0, self.axes[i])

    def _reduce(self, tensors, red, dtype, outs) -> None:
        flat = []
        for i in red:
            t = tensors[i].reshape(-1).to(self.comm_device)
            w = self.weights[i]
            flat.append(torch.zeros_like(t) if w == 0 else (t if w == 1 else t * w))
        buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
        dist.all_reduce(buf, group=self.group)
        o = 0
        for i in red:
            n = math.prod(self.shapes[i])
            outs[i] = buf[o : o + n].view(self.shapes[i]).to(self.devices[i])
            o += n

    # backward -----------------------------------------------------------------------------------------------
    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in range(len(grads)):
            if self.dtypes[i].is_floating_point or self.dtypes[i].is_complex:
                by_dtype.setdefault(self.dtypes[i], []).append(i)
        for dtype, idx in by_dtype.items():
            flat = []
            for i in idx:
                g = grads[i]
                flat.append(g.reshape(-1).to(self.comm_device))  # materialized: zeros where unused
            buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            if buf.numel():
                dist.all_reduce(buf, group=self.group)  # Σ over ranks of ∂L_r/∂(gathered output)
            o = 0
            for i in idx:
                n = grads[i].numel()
                g = buf[o : o + n].view(grads[i].shape).to(self.devices[i])
                o += n
                if self.kinds[i] == "red":
                    w = self.weights[i]
                    out[i] = torch.zeros(self.shapes[i], dtype=dtype, device=self.devices[i]) if w == 0 else g * w
                else:  # this rank's rows of the summed gradient
                    start = sum(self.rows[i][: self.rank])
                    n_rows = self.rows[i][self.rank]
                    if len(self.shapes[i]) == 0:
                        out[i] = g[start] if n_rows else torch.zeros((), dtype=dtype, device=self.devices[i])
                        continue
                    axis = self.axes[i]
                    mine = g.narrow(axis, start, n_rows)
                    if mine.shape[axis] != self.shapes[i][axis]:  # inactive rank: its (full-input) rows don't count
                        z = torch.zeros(self.shapes[i], dtype=dtype, device=self.devices[i])
                        out[i] = z
                    else:
                        out[i] = mine
        return out


def fingerprint(items: Sequence[Any]) -> int:
    h = hashlib.blake2b(repr(list(items)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)
