"""dpfast.distributed.outputs: the bytes of the output exchange of ``gather_outputs=True``.

Each rank writes its header, rows and tensors into one buffer (``_payload_bytes``); every rank reads every rank's
parts back out of the gathered bytes (``_decode``). Whatever the outputs (dtypes, dims, non-contiguous tensors,
rows along another axis, reductions) and whatever each rank's row count, what is read is exactly what was written:
the ranks' tensors, their rows concatenated in rank order ("cat") or one per rank ("red"). The exchange itself, on
2 and 3 ranks, is in test_distributed.py and test_distributed_per_rank.py."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast.distributed.group import RankGroup
from dpfast.distributed.output_layout import sort_outputs
from dpfast.distributed.outputs import _decode, _ints, _payload_bytes

CPU = RankGroup(None, 0, 1, torch.device("cpu"))
DTYPES = [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64, torch.float16]


def _tensor(shape, dtype, transposed, grad):
    t = (torch.randn(shape) * 10).to(dtype)
    if transposed and t.dim() >= 2:
        t = t.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, not contiguous
    return t.requires_grad_(grad and (dtype.is_floating_point or dtype.is_complex))


leaves = st.tuples(
    st.lists(st.integers(0, 4), min_size=0, max_size=3),  # shape
    st.sampled_from(DTYPES),
    st.booleans(),  # not contiguous
    st.booleans(),  # requires_grad
    st.sampled_from([0, 1, -1, "sum"]),  # out_dims of the leaf
)


def _fit(t, spec):
    """A spec the tensor has: an int spec it lacks becomes 0 (or "sum" for a 0-dim one); bools are not summed."""
    if isinstance(spec, int) and (not t.dim() and spec != 0 or t.dim() and not -t.dim() <= spec < t.dim()):
        spec = 0 if t.dim() else "sum"
    return 0 if spec == "sum" and t.dtype == torch.bool else spec


@settings(max_examples=150, deadline=None)
@given(st.lists(leaves, min_size=1, max_size=4), st.integers(1, 3), st.booleans())
def test_every_ranks_tensors_are_read_back(specs, world, in_first_buffer):
    """``world`` ranks' bytes, placed alike after a header or alone: each "cat" tensor comes back as the ranks' rows
    in rank order (rows along its axis), each "red" one as every rank's tensor; the header as it was written."""
    per_rank, dims = [], []
    for shape, dtype, transposed, grad, spec in specs:
        t = _tensor(shape, dtype, transposed, grad)
        dims.append(_fit(t, spec))
        per_rank.append(t)
    ranks = [
        tuple(t.detach() + r if t.dtype not in (torch.bool,) else t.detach() for t in per_rank) for r in range(world)
    ]
    sorted_ = [sort_outputs(outs, tuple(dims), 0, True) for outs in ranks]
    layout = sorted_[0].layout
    rows = layout.own_rows(True)
    place = layout.placement(rows)
    base = 64 if in_first_buffer else 0
    header = [[r, -r, 2**40 + r] for r in range(world)]
    size = base + max(place.size, 16)  # (as in the exchange: never a buffer of no bytes, its rows 16-byte aligned)
    sent = [
        _payload_bytes(size, CPU, (header[r] if base else []) + list(rows), got, place, base)
        for r, got in enumerate(sorted_)
    ]
    gathered = torch.stack(sent)
    if base:
        assert _ints(gathered, 3) == header
    parts = _decode(layout, gathered, base, [rows] * world)
    for i, (kind, axis) in enumerate(zip(layout.kinds, layout.axes)):
        mine = [got.tensors[i].detach() for got in sorted_]
        if kind == "red":
            assert len(parts[i]) == world and all(torch.equal(p, m) for p, m in zip(parts[i], mine))
        else:
            want = torch.cat([m.movedim(axis, 0) if m.dim() else m.reshape(1) for m in mine])
            assert torch.equal(torch.cat(parts[i]), want)


def test_a_rank_whose_outputs_do_not_count_sends_no_rows():
    """An inactive rank sends no rows of a "cat" tensor; its "mean" contribution is there."""
    got = sort_outputs((torch.randn(3, 2), torch.tensor(2.0)), (0, "mean"), 0, True)
    rows = got.layout.own_rows(False)
    place = got.layout.placement(rows)
    sent = _payload_bytes(place.size, CPU, list(rows), got, place, 0)
    assert rows == (0,) and sent[:8].view(torch.int64).tolist() == [0]
    assert sent[place.offsets[1] : place.offsets[1] + 4].view(torch.float32).tolist() == [2.0]


def test_a_torch_function_mode_sees_every_write():
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    got = sort_outputs(torch.randn(4, 3), 0, 0, True)
    place = got.layout.placement(got.layout.own_rows(True))
    with Mode():
        out = _payload_bytes(128, CPU, [1], got, place, 64)
    assert out.shape == (128,) and seen


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=3), st.sampled_from([torch.float32, torch.int64]))
def test_ranks_of_other_row_counts_are_decoded_each_by_its_own_placement(rows_per_rank, dtype):
    """Every rank sent its own rows of a "cat" tensor (any count, none too), of a "cat" tensor along its last axis,
    and a "sum": each rank's part is read where its own placement put it."""
    sent, rows, cat_a, cat_b, summed = [], [], [], [], []
    for r, n in enumerate(rows_per_rank):
        a, b, c = (torch.randn(n, 3) * 9).to(dtype), (torch.randn(2, n) * 9).to(dtype), torch.full((2,), r, dtype=dtype)
        got = sort_outputs((a, b, c), (0, -1, "sum"), 0, True)
        mine = got.layout.own_rows(n > 0)
        place = got.layout.placement(mine)
        sent.append(_payload_bytes(place.size, CPU, list(mine), got, place, 0))
        rows.append(mine)
        cat_a.append(a)
        cat_b.append(b.t())
        summed.append(c)
    width = max(t.numel() for t in sent)
    gathered = torch.stack([torch.cat([t, torch.zeros(width - t.numel(), dtype=torch.uint8)]) for t in sent])
    assert _ints(gathered, 2) == [list(r) for r in rows]
    decoded = _decode(got.layout, gathered, 0, rows)  # (any rank's layout: they agree on all but their own rows)
    for parts, want in zip(decoded[:2], (torch.cat(cat_a), torch.cat(cat_b))):
        assert torch.equal(torch.cat(parts) if parts else want[:0], want)
    assert len(decoded[2]) == len(summed) and all(torch.equal(g, w) for g, w in zip(decoded[2], summed))
