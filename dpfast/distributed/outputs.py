"""``gather_outputs=True``: combine every rank's outputs so each rank holds the full-batch result.

Int specs are concatenated in rank order (any row count per rank), ``"sum"``/``"mean"`` reduced across ranks
(``"mean"`` weighted by share), ``None`` keeps this rank's value.

One all-gather of bytes carries everything, and the step's check with it: each rank sends a fixed header (its check
row, whether it could sort its outputs, a fingerprint of their layout, its payload size and rows) and, in the same
buffer, its payload, when that fits the capacity the ranks agreed on at the previous exchange. Only when a payload
does not fit (the first exchange, or larger outputs) does a second all-gather follow, sized from the headers; a
disagreement found in the headers raises on every rank before anything is decoded.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.containers import TreeDef
from ..trees.flatten import unflatten
from ..trees.specs import Leaf, Spec, match_spec
from .agreement import NAME, DistributedBatchError, error_line, fingerprint
from .exchanges import Exchange, GatheredOutputs, RankGroup, row_shape

HEADER_FIELDS = 8  # step status, check fingerprint, forwards, gather status, layout fingerprint, bytes, rows, 0
_HEADER_BYTES = 8 * HEADER_FIELDS
_ALIGN = 16


@dataclasses.dataclass
class _Leaves:
    """The output's leaves sorted for one exchange: numbers under "sum"/"mean" travel as 0-dim tensors."""

    tdef: TreeDef | None = None
    leaves: list[Leaf] = dataclasses.field(default_factory=list)
    slots: list[tuple] = dataclasses.field(default_factory=list)  # per leaf: ("keep",) | ("t", index, number type)
    tensors: list[Tensor] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)  # per tensor: "cat" | "red"
    reductions: list[str] = dataclasses.field(default_factory=list)  # per tensor: "sum" | "mean" | ""
    axes: list[int] = dataclasses.field(default_factory=list)
    desc: list[Any] = dataclasses.field(default_factory=list)  # what every rank must agree on


def _reduced_leaf(got: _Leaves, leaf: Leaf) -> None:
    v, s = leaf.value, leaf.spec
    if isinstance(v, Tensor):
        t, num = v, None
    elif isinstance(v, numbers.Number) and not isinstance(v, bool):
        num = type(v) if s == "sum" and isinstance(v, int) else float
        t = torch.tensor(v, dtype=torch.int64 if num is int else torch.float64)
    else:
        raise TypeError(
            f"output `{leaf.path}` is a {type(v).__name__}; out_dims {s!r} needs tensors or numbers from every rank"
        )
    got.desc.append((leaf.path, s, tuple(t.shape), str(t.dtype)))
    got.slots.append(("t", len(got.tensors), num))
    got.tensors.append(t)
    got.kinds.append("red")
    got.reductions.append(s)
    got.axes.append(0)


def _concatenated_leaf(got: _Leaves, leaf: Leaf) -> None:
    v, s = leaf.value, leaf.spec
    if isinstance(v, PackedSequence):
        raise TypeError(
            f"output `{leaf.path}` is a PackedSequence, which gather_outputs cannot all-gather yet; return it padded "
            "(torch.nn.utils.rnn.pad_packed_sequence), or give it out_dims None to keep this rank's own value"
        )
    if not isinstance(v, Tensor):
        raise TypeError(
            f"output `{leaf.path}` is a {type(v).__name__}, which cannot be concatenated along axis {s}; give it "
            "out_dims None (this rank's value), 'sum' or 'mean'"
        )
    if v.dim() and not -v.dim() <= s < v.dim():
        raise ValueError(
            f"output `{leaf.path}` has shape {tuple(v.shape)}: axis {s} is out of range; give it another out_dims "
            "axis, or None/'sum'/'mean'"
        )
    axis = s % v.dim() if v.dim() else 0
    got.desc.append((leaf.path, "cat", axis, v.dim(), str(v.dtype), row_shape(tuple(v.shape), axis)))
    got.slots.append(("t", len(got.tensors), None))
    got.tensors.append(v)
    got.kinds.append("cat")
    got.reductions.append("")
    got.axes.append(axis)


def _sort_leaves(out: Any, spec: Spec, dim: int, explicit: bool) -> _Leaves:
    got = _Leaves()
    got.tdef = match_spec(out, spec, "output", dim, explicit, "out_dims", got.leaves)
    for leaf in got.leaves:
        v, s = leaf.value, leaf.spec
        if v is None or s is None:
            got.desc.append((leaf.path, "keep", repr(s), v is None))
            got.slots.append(("keep",))
        elif s == "items":
            raise TypeError(
                f"output `{leaf.path}` has out_dims 'items', which gather_outputs cannot all-gather yet; give it "
                "out_dims None to keep this rank's own items"
            )
        elif isinstance(s, str):
            _reduced_leaf(got, leaf)
        else:
            _concatenated_leaf(got, leaf)
    return got


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Payload:
    """This rank's payload: the rows of each "cat" tensor (int64), then every tensor's bytes, 16-byte aligned; kept
    as views and written straight into the all-gather's buffer. A rank whose outputs do not count sends no rows
    ("cat") and values that get weight 0 ("red")."""

    def __init__(self, got: _Leaves, active: bool) -> None:
        cat = [(t, a) for t, k, a in zip(got.tensors, got.kinds, got.axes) if k == "cat"]
        rows = [(1 if t.dim() == 0 else t.shape[a]) if active else 0 for t, a in cat]
        self.chunks = [torch.tensor(rows, dtype=torch.int64).view(torch.uint8)] if cat else []
        for t, kind, axis in zip(got.tensors, got.kinds, got.axes):
            if kind == "cat":
                t = t.reshape(1) if t.dim() == 0 else t.movedim(axis, 0)
                t = t if active else t[:0]
            self.chunks.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
        self.size = sum(_aligned(c.numel()) for c in self.chunks)

    def write(self, out: Tensor) -> None:
        offset = 0
        for c in self.chunks:
            out[offset : offset + c.numel()] = c
            offset += _aligned(c.numel())


def _all_gather(group: RankGroup, buf: Tensor) -> list[Tensor]:
    bufs = [torch.empty_like(buf) for _ in range(group.world)]
    dist.all_gather(bufs, buf, group=group.process_group)
    return bufs


def _exchange_bytes(group: RankGroup, header: list[int], payload: _Payload, capacity: int) -> tuple[list, list, int]:
    """Headers and payloads of every rank (one all-gather when every payload fits ``capacity``), and the capacity
    to use next time (the same on every rank: it is computed from the headers)."""
    first = torch.zeros(_HEADER_BYTES + capacity, dtype=torch.uint8, device=group.comm_device)
    first[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
    if payload.size <= capacity:
        payload.write(first[_HEADER_BYTES:])
    bufs = _all_gather(group, first)
    headers = torch.stack([b[:_HEADER_BYTES] for b in bufs]).view(torch.int64).tolist()
    sizes = [h[5] for h in headers]
    widest = max(sizes)
    if widest <= capacity:
        payloads = [b[_HEADER_BYTES : _HEADER_BYTES + n] for b, n in zip(bufs, sizes)]
        new_capacity = capacity if 4 * widest >= capacity else _aligned(widest * 5 // 4)
        return headers, payloads, new_capacity
    return headers, None, _aligned(widest * 5 // 4)


def _second_round(group: RankGroup, payload: _Payload, sizes: Sequence[int]) -> list[Tensor]:
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=group.comm_device)
    payload.write(buf)
    return [b[:n] for b, n in zip(_all_gather(group, buf), sizes)]


def _decode(got: _Leaves, payloads: Sequence[Tensor]) -> tuple[list[list[int]], list[list[Tensor]]]:
    """Every rank's rows per "cat" tensor and its contribution per tensor, as views of the gathered bytes."""
    n_cat = got.kinds.count("cat")
    head = torch.stack([p[: 8 * n_cat] for p in payloads]).view(torch.int64).tolist() if n_cat else [[]] * len(payloads)
    pieces = []
    for p, cat_rows in zip(payloads, head):
        offset, it, mine = _aligned(8 * n_cat), iter(cat_rows), []
        for t, kind, axis in zip(got.tensors, got.kinds, got.axes):
            shape = tuple(t.shape)
            if kind == "cat":
                shape = (next(it),) + row_shape(shape, axis)
            n = t.element_size() * math.prod(shape)
            mine.append(p[offset : offset + n].view(t.dtype).view(shape))
            offset += _aligned(n)
        pieces.append(mine)
    rows = [[head[r][j] for r in range(len(payloads))] for j in range(n_cat)]
    return rows, pieces


@dataclasses.dataclass
class OutputsCall:
    """What one gather needs besides the outputs: the check row and how to verify the ranks' rows, this rank's
    share (global batch: every rank's rows; per-rank inputs: its own), and the agreed capacity."""

    group: RankGroup
    out_dims: Spec
    dim: int
    check_row: list[int]
    verify: Callable[[list[list[int]]], None]  # raises on every rank when the ranks' check rows disagree
    sizes: Sequence[int] | None  # rows per rank of the global batch (() when nothing was split); None: per rank
    local_rows: int | None  # per-rank inputs: this rank's rows (None when nothing is split)
    capacity: int


def gather_across_ranks(call: OutputsCall, out: Any, failed: bool) -> tuple[Any, list[int] | None, int]:
    """Every rank's ``out`` combined as ``out_dims`` says (a collective: every rank calls it); returns it, every
    rank's rows (per-rank inputs; else None) and the next capacity. ``failed``: this rank has no outputs (it could
    not run its part; its check row says why), so it only takes part in the exchange."""
    g = call.group
    spec = call.dim if call.out_dims is None else call.out_dims
    error: BaseException | None = None
    got = _Leaves()
    if not failed:
        try:
            got = _sort_leaves(out, spec, call.dim, call.out_dims is not None)
        except (TypeError, ValueError) as exc:
            error, got = exc, _Leaves(desc=[("error", error_line(exc))])
    active = _active(call, g.rank)
    payload = _Payload(got, active)
    layout = fingerprint(got.desc)
    rows_field = -1 if call.local_rows is None else call.local_rows
    header = call.check_row + [1 if error is not None else 0, layout, payload.size, rows_field, 0]
    headers, payloads, capacity = _exchange_bytes(g, header, payload, call.capacity)
    call.verify([h[:3] for h in headers])  # a rank that could not plan or run its part: raised on every rank here
    if any(h[3] for h in headers) or len({h[4] for h in headers}) > 1:
        _raise_output_disagreement(g, got, error, [r for r, h in enumerate(headers) if h[3]])
    per_rank = [h[6] for h in headers] if call.sizes is None else None
    if not got.tensors:
        return out, per_rank, capacity
    if payloads is None:
        payloads = _second_round(g, payload, [h[5] for h in headers])
    rows, pieces = _decode(got, payloads)
    return _assemble(call, got, rows, pieces, per_rank), per_rank, capacity


def _active(call: OutputsCall, rank: int) -> bool:
    if call.sizes is None:
        return (call.local_rows or 0) > 0 if call.local_rows is not None else rank == 0
    return call.sizes[rank] > 0 if call.sizes else rank == 0


def _weights(call: OutputsCall, per_rank: list[int] | None, world: int) -> tuple[list[float], list[float]]:
    """Each rank's factor in a "mean" (its share of the batch) and in a "sum" (1 if its outputs count)."""
    sizes = list(call.sizes) if call.sizes is not None else per_rank
    if sizes and min(sizes) >= 0 and sum(sizes) > 0:
        total = sum(sizes)
        return [s / total for s in sizes], [1.0 if s > 0 else 0.0 for s in sizes]
    first = [1.0 if r == 0 else 0.0 for r in range(world)]  # nothing split: rank 0 ran the whole input
    return first, first


def _assemble(call: OutputsCall, got: _Leaves, rows: list, pieces: list, per_rank: list[int] | None) -> Any:
    g = call.group
    mean_w, sum_w = _weights(call, per_rank, g.world)
    it = iter(rows)
    gathered = GatheredOutputs(
        g,
        got.kinds,
        got.axes,
        [tuple(t.shape) for t in got.tensors],
        [t.dtype for t in got.tensors],
        [t.device for t in got.tensors],
        [next(it) if k == "cat" else None for k in got.kinds],
        mean_w,
        sum_w,
        got.reductions,
        pieces,
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in got.tensors):
        results = Exchange.apply(gathered, *got.tensors)
    else:
        results = gathered.assemble()
    values = []
    for leaf, slot in zip(got.leaves, got.slots):
        if slot[0] == "keep":
            values.append(leaf.value)
            continue
        res = results[slot[1]]
        values.append(res.item() if slot[2] is int else (float(res.item()) if slot[2] is float else res))
    return unflatten(got.tdef, values)


def _raise_output_disagreement(group: RankGroup, got: _Leaves, error: BaseException | None, failed: list[int]) -> None:
    summaries: list[Any] = [None] * group.world
    dist.all_gather_object(summaries, list(got.desc), group=group.process_group)
    name = f"{NAME}(gather_outputs=True)"
    if failed:
        many = len(failed) > 1
        lines = [
            f"{name}: rank{'s' if many else ''} {', '.join(map(str, failed))} could not gather "
            f"{'their' if many else 'its'} outputs, so no rank gathers them"
        ]
    else:
        lines = [
            f"{name}: the ranks returned different output structures (paths, specs, dtypes or non-batch shapes "
            "differ); every rank must return the same structure to be gathered"
        ]
    for i, s in enumerate(summaries):
        lines.append(f"  rank {i}{' (this rank)' if i == group.rank else ''}: {s}")
    if error is not None:
        raise DistributedBatchError("\n".join(lines) + "\n" + str(error)) from error
    raise DistributedBatchError("\n".join(lines))
