"""``gather_outputs=True``: combine every rank's outputs so each rank holds the full-batch result.

Int specs are concatenated in rank order (any row count per rank), ``"sum"``/``"mean"`` reduced across ranks
(``"mean"`` weighted by share), ``None`` keeps this rank's value.

One all-gather of bytes carries everything, and the step's check with it: each rank sends a fixed header (its check
row, whether it could sort its outputs, a fingerprint of their layout, its payload size and rows) and, in the same
buffer, its payload, when that fits the capacity the ranks agreed on at the previous exchange. Only when a payload
does not fit (the first exchange, or larger outputs) does a second all-gather follow, sized from the headers; a
disagreement found in the headers raises on every rank before anything is decoded. Where each output goes in the
bytes is its layout (:mod:`dpfast.distributed.output_layout`), made once per key and shapes; the header and the
payload's rows are read in one go, and a tensor whose every rank sent as many rows is read out of the gathered bytes
in one piece.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..trees.containers import LEAF
from ..trees.facts import memory_order
from ..trees.flatten import unflatten
from ..trees.specs import Spec
from .agreement import fingerprint
from .disagreement import NAME, DistributedBatchError, error_line
from .group import RankGroup
from .output_adjoint import Exchange, GatheredOutputs
from .output_layout import ExchangeLayouts, OutputLayout, Placement, SortedOutputs, aligned

# step status, check fingerprint, forwards, gather status, layout fingerprint, bytes, rows, grad and formats
HEADER_FIELDS = 8
_HEADER_BYTES = 8 * HEADER_FIELDS
_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
_FORMAT_BITS = 62  # the first spatial tensors whose memory format the header carries (bits 1..62 of its last field)


def _payload_bytes(
    size: int, group: RankGroup, ints: list[int], got: SortedOutputs | None, place: Placement, base: int
) -> Tensor:
    """``size`` bytes to send: ``ints`` (int64) from byte 0; then, with ``got``, its tensors' bytes where ``place``
    puts them in a payload that starts at ``base`` ("cat" tensors with their rows along axis 0); zeros elsewhere.
    One ``torch.cat`` of byte views (a tensor not contiguous in that order is copied once)."""
    device = group.comm_device
    pieces = [torch.frombuffer(array.array("q", ints), dtype=torch.uint8).to(device)] if ints else []
    at = 8 * len(ints)
    if got is not None:
        layout = got.layout
        with torch.no_grad():
            for t, kind, axis, off, n in zip(got.tensors, layout.kinds, layout.axes, place.offsets, place.nbytes):
                if n:
                    src = t.movedim(axis, 0) if axis and kind == "cat" else t  # (a 0-dim "cat" tensor: one row)
                    pieces.append(_zeros(base + off - at, device))
                    pieces.append(src.reshape(-1).view(torch.uint8).to(device))
                    at = base + off + n
    pieces.append(_zeros(size - at, device))
    return torch.cat(pieces)


_ZEROS: dict[tuple[int, torch.device], Tensor] = {}


def _zeros(n: int, device: torch.device) -> Tensor:
    """``n`` zero bytes on ``device``: the gaps of a payload, the same few sizes every step (never written to)."""
    got = _ZEROS.get((n, device))
    if got is None:
        if len(_ZEROS) >= 64:
            _ZEROS.clear()
        got = _ZEROS[(n, device)] = torch.zeros(n, dtype=torch.uint8, device=device)
    return got


def _ints(gathered: Tensor, count: int) -> list[list[int]]:
    """The first ``count`` int64 of every rank's gathered bytes."""
    return gathered[:, : 8 * count].view(torch.int64).tolist()


def _gathered(group: RankGroup, send: Tensor) -> Tensor:
    """Every rank's ``send``, one row each (a ``(world, len(send))`` view of one buffer)."""
    recv = torch.empty(group.world * send.numel(), dtype=torch.uint8, device=send.device)
    # one all-gather into one buffer: all_gather_into_tensor (torch 2.4's gloo has it), all_gather_single in newer
    # torch; looked up at the call, as torch.distributed's own functions are, so that a wrapper of them sees it
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_into(recv, send, group=group.process_group)
    return recv.view(group.world, send.numel())


@dataclasses.dataclass
class _Exchanged:
    """What the first all-gather brought: every rank's header, and, when every payload fitted, the gathered bytes
    (payloads from column ``base``) and every rank's rows of each "cat" tensor."""

    headers: list[list[int]]
    gathered: Tensor | None
    rows: list[tuple[int, ...]] | None
    capacity: int  # for the next exchange (the same on every rank: it is computed from the headers)


def _exchange_bytes(
    group: RankGroup, header: list[int], got: SortedOutputs, rows: tuple, place: Placement, capacity: int
) -> _Exchanged:
    """Headers and payloads of every rank: one all-gather when every payload fits ``capacity``."""
    n_cat = got.layout.n_cat
    fits = place.size <= capacity
    ints = header + list(rows) if fits else header
    send = _payload_bytes(_HEADER_BYTES + capacity, group, ints, got if fits else None, place, _HEADER_BYTES)
    gathered = _gathered(group, send)
    width = HEADER_FIELDS + (n_cat if 8 * n_cat <= capacity else 0)  # the rows follow the header, if they fit
    ints = _ints(gathered, width)
    headers = [row[:HEADER_FIELDS] for row in ints]
    widest = max(h[5] for h in headers)
    if widest <= capacity:
        new_capacity = capacity if 4 * widest >= capacity else aligned(widest * 5 // 4)
        return _Exchanged(headers, gathered, [tuple(row[HEADER_FIELDS:]) for row in ints], new_capacity)
    return _Exchanged(headers, None, None, aligned(widest * 5 // 4))


def _second_round(
    group: RankGroup, got: SortedOutputs, rows: tuple, place: Placement, sizes: Sequence[int]
) -> tuple[Tensor, list[tuple[int, ...]]]:
    """Every rank's payload when one did not fit the first all-gather: the gathered bytes and every rank's rows."""
    send = _payload_bytes(max(sizes), group, list(rows), got, place, 0)
    gathered = _gathered(group, send)
    n_cat = got.layout.n_cat
    rows_all = _ints(gathered, n_cat) if n_cat else [[]] * group.world
    return gathered, [tuple(r) for r in rows_all]


def _decode(layout: OutputLayout, gathered: Tensor, base: int, rows: list[tuple]) -> list[list[Tensor]]:
    """Per tensor, every rank's part of the gathered bytes (payloads from column ``base``): a "cat" tensor's parts
    of the ranks with rows, in rank order (one part, every rank's rows, when every rank sent as many), a "red"
    tensor's contribution of every rank."""
    world = len(rows)
    if all(r == rows[0] for r in rows):  # one placement for every rank: each tensor is one block of the bytes
        place = layout.placement(rows[0])
        parts = []
        for kind, dtype, off, n, shape in zip(layout.kinds, layout.dtypes, place.offsets, place.nbytes, place.shapes):
            block = gathered[:, base + off : base + off + n].view(dtype).view((world, *shape))
            if kind == "red":
                parts.append(list(block.unbind(0)))
            else:
                parts.append([block.reshape((world * shape[0], *shape[1:]))])
        return parts
    places = [layout.placement(r) for r in rows]
    parts = [[] for _ in layout.kinds]
    for r, place in enumerate(places):
        mine = gathered[r]
        for i, (kind, dtype) in enumerate(zip(layout.kinds, layout.dtypes)):
            shape = place.shapes[i]
            if kind == "cat" and not shape[0]:
                continue
            off = base + place.offsets[i]
            parts[i].append(mine[off : off + place.nbytes[i]].view(dtype).view(shape))
    return parts


@dataclasses.dataclass
class OutputsCall:
    """What one gather needs besides the outputs: the check row and how to verify the ranks' rows, this rank's
    share (global batch: every rank's rows; per-rank inputs: its own), and what the wrapper's exchange keeps from
    call to call (the agreed capacity, the last layout)."""

    group: RankGroup
    out_dims: Spec
    dim: int
    check_row: list[int]
    verify: Callable[[list[list[int]]], None]  # raises on every rank when the ranks' check rows disagree
    sizes: Sequence[int] | None  # rows per rank of the global batch (() when nothing was split); None: per rank
    local_rows: int | None  # per-rank inputs: this rank's rows (None when nothing is split)
    kept: ExchangeLayouts
    name: str = NAME  # the wrapper's, which heads the exchange's errors


def gather_across_ranks(call: OutputsCall, out: Any, failed: bool) -> tuple[Any, list[int] | None]:
    """Every rank's ``out`` combined as ``out_dims`` says (a collective: every rank calls it); returns it and every
    rank's rows (per-rank inputs; else None). ``failed``: this rank has no outputs (it could not run its part; its
    check row says why), so it only takes part in the exchange. The next capacity is kept as soon as the headers
    are read, so that a rank that raises afterwards still sends what the others expect at the next call."""
    g = call.group
    spec = call.dim if call.out_dims is None else call.out_dims
    error: BaseException | None = None
    got = None
    if not failed:
        try:
            got = call.kept.sort(out, spec, call.dim, call.out_dims is not None)
        except Exception as exc:  # whatever it is, the other ranks must hear of it in the exchange, not wait
            error = exc
    if got is None:
        layout = OutputLayout(desc=[("error", error_line(error))] if error is not None else [])
        layout.fp = fingerprint(layout.desc)
        got = SortedOutputs(layout, None, [], [])
    layout = got.layout
    active = _active(call, g.rank)
    rows = layout.own_rows(active)
    place = layout.placement(rows)
    rows_field = -1 if call.local_rows is None else call.local_rows
    # bit 0: whether this rank's gathered outputs join the graph (then its backward exchanges their gradients,
    # which every rank must do or none); bits 1..: which of its 4-d/5-d tensors are channels_last
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in got.tensors)
    flags = int(needs_grad) | (_channels_last_bits(layout, got.tensors) << 1 if layout.spatial else 0)
    header = call.check_row + [1 if error is not None else 0, layout.fp, place.size, rows_field, flags]
    ex = _exchange_bytes(g, header, got, rows, place, call.kept.capacity)
    call.kept.capacity = ex.capacity
    headers = ex.headers
    call.verify([h[:3] for h in headers])  # a rank that could not plan or run its part: raised on every rank here
    if any(h[3] for h in headers) or len({h[4] for h in headers}) > 1:
        _raise_output_disagreement(g, layout, error, [r for r, h in enumerate(headers) if h[3]], call.name)
    if len({h[7] & 1 for h in headers}) > 1:
        _raise_grad_disagreement(g, [bool(h[7] & 1) for h in headers], call.name)
    per_rank = [h[6] for h in headers] if call.sizes is None else None
    if not got.tensors:
        return out, per_rank
    if ex.gathered is not None:
        gathered, base, all_rows = ex.gathered, _HEADER_BYTES, ex.rows
    else:
        (gathered, all_rows), base = _second_round(g, got, rows, place, [h[5] for h in headers]), 0
    parts = _decode(layout, gathered, base, all_rows)
    formats = _agreed_formats(layout, headers) if layout.spatial else {}
    return _assemble(call, got, all_rows, parts, per_rank, needs_grad, formats), per_rank


def _channels_last_bits(layout: OutputLayout, tensors: list[Tensor]) -> int:
    """Bit k: the k-th 4-d/5-d tensor of this rank's outputs is channels_last (read every call: the kept layout
    is keyed on sizes, not strides). A rank without rows has empty ones, which read as contiguous."""
    bits = 0
    for k, i in enumerate(layout.spatial[:_FORMAT_BITS]):
        if memory_order(tensors[i]) is not None:
            bits |= 1 << k
    return bits


def _agreed_formats(layout: OutputLayout, headers: list[list[int]]) -> dict:
    """The gathered tensors that come back channels_last, the same on every rank: those some rank's output was
    channels_last for, as torch.cat of all-gathered copies of it would be (a rank without rows has no say)."""
    bits = 0
    for h in headers:
        bits |= h[7] >> 1
    return {i: _LAST[len(layout.shapes[i])] for k, i in enumerate(layout.spatial[:_FORMAT_BITS]) if bits >> k & 1}


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


def _assemble(
    call: OutputsCall,
    got: SortedOutputs,
    rows: list[tuple],
    parts: list,
    per_rank: list[int] | None,
    needs_grad: bool,
    formats: dict,
) -> Any:
    g = call.group
    mean_w, sum_w = _weights(call, per_rank, g.world)
    gathered = GatheredOutputs(g, got.layout, rows, mean_w, sum_w, parts, formats)
    results = Exchange.apply(gathered, *got.tensors) if needs_grad else gathered.assemble()
    values = list(got.values)
    for i, slot in enumerate(got.layout.slots):
        if slot[0] == "t":
            res = results[slot[1]]
            values[i] = res.item() if slot[2] is int else (float(res.item()) if slot[2] is float else res)
    return values[0] if got.tdef is LEAF else unflatten(got.tdef, values)


def _raise_grad_disagreement(group: RankGroup, needs: list[bool], name: str) -> None:
    yes = [r for r, n in enumerate(needs) if n]
    no = [r for r, n in enumerate(needs) if not n]
    lines = [
        f"{name}(gather_outputs=True): the outputs need grad on rank{'s' if len(yes) > 1 else ''} "
        f"{', '.join(map(str, yes))} and not on rank{'s' if len(no) > 1 else ''} {', '.join(map(str, no))}. Their "
        "backward is a collective, so every rank's outputs must need grad or none's: run every rank's forward with "
        "grad enabled or under torch.no_grad() alike, and detach outputs on every rank or on none"
    ]
    for r, n in enumerate(needs):
        what = "an output needs grad" if n else "no output needs grad (or grad is disabled)"
        lines.append(f"  rank {r}{' (this rank)' if r == group.rank else ''}: {what}")
    raise DistributedBatchError("\n".join(lines))


def _raise_output_disagreement(
    group: RankGroup, layout: OutputLayout, error: BaseException | None, failed: list[int], wrapper: str
) -> None:
    summaries: list[Any] = [None] * group.world
    dist.all_gather_object(summaries, list(layout.desc), group=group.process_group)
    name = f"{wrapper}(gather_outputs=True)"
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
