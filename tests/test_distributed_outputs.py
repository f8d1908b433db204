"""dpfast.distributed.outputs and exchange_calls: the bytes of the output exchange of ``gather_outputs=True``.

The extension writes one rank's bytes, reads every rank's header and cuts every tensor's part of the gathered bytes
in one call each; each must give exactly what Python's own path gives (``_write``, ``tolist``, ``_decode``'s
slices) for every layout, and decline (None, nothing made) whatever it cannot place: a tensor that is not a plain
dense one, or bytes outside the buffer or misaligned for their dtype. The exchange itself, on 2 and 3 ranks, is in
test_distributed.py and test_distributed_per_rank.py."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast.distributed import exchange_calls
from dpfast.distributed.exchange_calls import pack_payload
from dpfast.distributed.exchanges import RankGroup
from dpfast.distributed.output_layout import sort_outputs
from dpfast.distributed.outputs import _decode, _payload_bytes, _write
from dpfast.ext.loader import LOADED

pytestmark = pytest.mark.skipif(not LOADED, reason="the one-call payload is the compiled extension's")

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


@settings(max_examples=150, deadline=None)
@given(st.lists(leaves, min_size=1, max_size=5), st.integers(0, 3), st.booleans())
def test_the_extensions_bytes_are_pythons(specs, extra_ints, in_first_buffer):
    """Any outputs, with the header and rows in front or only the rows: the same bytes as Python writes."""
    outs, dims = [], []
    for shape, dtype, transposed, grad, spec in specs:
        t = _tensor(shape, dtype, transposed, grad)
        if isinstance(spec, int) and (not t.dim() and spec != 0 or t.dim() and not -t.dim() <= spec < t.dim()):
            spec = 0 if t.dim() else "sum"
        if spec == "sum" and dtype == torch.bool:
            spec = 0
        outs.append(t)
        dims.append(spec)
    got, _ = sort_outputs(tuple(outs), tuple(dims), 0, True)
    layout = got.layout
    rows = layout.own_rows(True)
    place = layout.placement(rows)
    base = 64 if in_first_buffer else 0
    ints = list(range(-3, 5 + extra_ints)) if in_first_buffer else list(rows)
    size = base + place.size + 16 * extra_ints
    fast = pack_payload(size, CPU.comm_device, ints, got.tensors, layout.move_axes, place.offsets, base)
    assert fast is not None and fast.dtype == torch.uint8 and fast.shape == (size,) and not fast.requires_grad
    want = torch.zeros(size, dtype=torch.uint8)
    _write(want, ints, got, place, base)
    assert torch.equal(fast, want)
    assert torch.equal(_payload_bytes(size, CPU, ints, got, place, base, True), want)


def test_a_rank_whose_outputs_do_not_count_sends_python_bytes():
    """An inactive rank sends no rows of a "cat" tensor: Python writes its payload, the same either way."""
    got, _ = sort_outputs((torch.randn(3, 2), torch.tensor(2.0)), (0, "mean"), 0, True)
    rows = got.layout.own_rows(False)
    place = got.layout.placement(rows)
    want = torch.zeros(place.size, dtype=torch.uint8)
    _write(want, list(rows), got, place, 0)
    assert torch.equal(_payload_bytes(place.size, CPU, list(rows), got, place, 0, False), want)
    assert want[8:].view(torch.float32)[1:2].tolist() == [0.0]  # no row of the "cat" tensor, the mean is there


class _Sub(torch.Tensor):
    pass


def test_what_the_extension_cannot_place_is_declined():
    x, cpu = torch.randn(4, 3), torch.device("cpu")

    def pack(size=64, ints=(1, 2), tensors=(x,), axes=(0,), offsets=(16,), base=0):
        return pack_payload(size, cpu, list(ints), list(tensors), list(axes), list(offsets), base)

    assert pack() is not None
    assert pack(size=75) is not None and pack(size=16 + 48 - 1) is None  # one byte short
    assert pack(offsets=(-16,)) is None
    assert pack(offsets=(18,), size=128) is None  # misaligned for float32
    assert pack(offsets=(2**62,), base=2**62) is None  # base + offset overflows
    assert pack(base=-1) is None and pack(size=-1) is None
    assert pack(ints=range(9)) is None  # 72 bytes of ints in 64
    assert pack(axes=(2,)) is None and pack(axes=(-1,)) is None and pack(axes=(0, 0)) is None
    assert pack(tensors=(x.as_subclass(_Sub),)) is None  # a subclass: Python's own path
    assert pack(tensors=(x.to_sparse(),)) is None
    with warnings.catch_warnings():  # (torch says its nested tensors are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([x, x])
    assert pack(tensors=(nested,)) is None
    assert pack(tensors=(torch.tensor(1.0),), axes=(1,)) is None
    assert pack(ints=(True,)) is None and pack(size=64.0) is None
    assert pack(tensors=(), axes=(), offsets=()) is not None


def test_a_torch_function_mode_sees_every_write():
    """Under a __torch_function__ mode the extension declines, and Python's writes are seen."""
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    got, _ = sort_outputs(torch.randn(4, 3), 0, 0, True)
    place = got.layout.placement(got.layout.own_rows(True))
    with Mode():
        assert pack_payload(128, torch.device("cpu"), [1], got.tensors, [0], place.offsets, 64) is None
        out = _payload_bytes(128, CPU, [1], got, place, 64, True)
    assert out.shape == (128,) and seen


@settings(max_examples=100, deadline=None)
@given(st.lists(leaves, min_size=1, max_size=4), st.integers(1, 3), st.booleans())
def test_every_ranks_parts_are_pythons_slices(specs, world, in_first_buffer):
    """Bytes of ``world`` ranks placed alike: the extension's headers are tolist's, and its parts of every tensor
    equal Python's slices of each rank's bytes, concatenated ("cat") or one per rank ("red")."""
    outs, dims = [], []
    for shape, dtype, _, _, spec in specs:
        t = _tensor(shape, dtype, False, False)
        spec = spec if isinstance(spec, int) and t.dim() and -t.dim() <= spec < t.dim() else "sum"
        outs.append(t)
        dims.append(0 if spec == "sum" and dtype == torch.bool else spec)
    got, _ = sort_outputs(tuple(outs), tuple(dims), 0, True)
    layout = got.layout
    rows = layout.own_rows(True)
    place = layout.placement(rows)
    base = 64 if in_first_buffer else 0
    size, header = base + max(place.size, 16), base // 8  # (a header of base // 8 ints, then the rows)
    sent = [_payload_bytes(size, CPU, [r] * header + list(rows), got, place, base, True) for r in range(world)]
    gathered = torch.stack(sent)
    count = header + len(rows)
    assert exchange_calls.int_rows(gathered, count) == gathered[:, : 8 * count].view(torch.int64).tolist()
    fast = exchange_calls.blocks(gathered, base, layout.dtypes, place.shapes, place.offsets, layout.is_cat)
    assert fast is not None
    for i, (t, cat) in enumerate(zip(got.tensors, layout.is_cat)):
        mine = gathered[:, base + place.offsets[i] : base + place.offsets[i] + place.nbytes[i]]
        each = [m.view(t.dtype).view(place.shapes[i]) for m in mine]
        want = torch.cat(each) if cat else torch.stack(each)
        assert fast[i].dtype == t.dtype and fast[i].shape == want.shape and torch.equal(fast[i], want)
    fast_parts = _decode(layout, gathered, base, [rows] * world)
    with _without_blocks():
        python_parts = _decode(layout, gathered, base, [rows] * world)
    for fast_p, python_p in zip(fast_parts, python_parts):
        assert len(fast_p) == len(python_p) and all(torch.equal(a, b) for a, b in zip(fast_p, python_p))


@contextlib.contextmanager
def _without_blocks():
    """Python's own path of _decode (the extension's _blocks declines)."""
    saved, exchange_calls._blocks = exchange_calls._blocks, None
    try:
        yield
    finally:
        exchange_calls._blocks = saved


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=3), st.sampled_from([torch.float32, torch.int64]))
def test_ranks_of_other_row_counts_are_decoded_each_by_its_own_placement(rows_per_rank, dtype):
    """Every rank sent its own rows of a "cat" tensor (any count, none too), of a "cat" tensor along its last axis,
    and a "sum": each rank's part is read where its own placement put it, by either path of _decode."""
    sent, rows, cat_a, cat_b, summed = [], [], [], [], []
    for r, n in enumerate(rows_per_rank):
        a, b, c = (torch.randn(n, 3) * 9).to(dtype), (torch.randn(2, n) * 9).to(dtype), torch.full((2,), r, dtype=dtype)
        got, _ = sort_outputs((a, b, c), (0, -1, "sum"), 0, True)
        mine = got.layout.own_rows(n > 0)
        place = got.layout.placement(mine)
        sent.append(_payload_bytes(place.size, CPU, list(mine), got, place, 0, n > 0))
        rows.append(mine)
        cat_a.append(a)
        cat_b.append(b.t())
        summed.append(c)
    width = max(t.numel() for t in sent)
    gathered = torch.stack([torch.cat([t, torch.zeros(width - t.numel(), dtype=torch.uint8)]) for t in sent])
    assert exchange_calls.int_rows(gathered, 2) == [list(r) for r in rows]
    layout = got.layout  # (any rank's: they agree on everything but their own rows)
    with _without_blocks():
        python = _decode(layout, gathered, 0, rows)
    for decoded in (_decode(layout, gathered, 0, rows), python):
        for parts, want in zip(decoded[:2], (torch.cat(cat_a), torch.cat(cat_b))):
            assert torch.equal(torch.cat(parts) if parts else want[:0], want)
        assert len(decoded[2]) == len(summed) and all(torch.equal(g, w) for g, w in zip(decoded[2], summed))


def test_what_the_extension_cannot_read_is_declined():
    g = torch.zeros(2, 64, dtype=torch.uint8)
    f32, cpu_rows = torch.float32, exchange_calls.int_rows
    assert cpu_rows(g, 8) == [[0] * 8] * 2 and cpu_rows(g, 0) == [[], []]
    assert cpu_rows(g, 9) is None and cpu_rows(g, -1) is None
    assert cpu_rows(g[:, 1:], 1) is None and cpu_rows(g.t(), 1) is None and cpu_rows(g.view(-1), 1) is None
    shifted = g.view(-1)[4:68].view(2, 32)  # rows that start 4 bytes into the storage
    assert cpu_rows(g.float(), 1) is None and cpu_rows(shifted, 1) is None

    def cut(gathered=g, base=0, dtypes=(f32,), shapes=((4, 2),), offsets=(16,), rows=(True,)):
        return exchange_calls.blocks(gathered, base, list(dtypes), list(shapes), list(offsets), list(rows))

    assert cut()[0].shape == (8, 2) and cut(rows=(False,))[0].shape == (2, 4, 2)
    assert cut(offsets=(33,)) is None and cut(offsets=(-16,)) is None  # outside a row, misaligned
    assert cut(shapes=((4, 3),)) is not None and cut(shapes=((4, 4),)) is None  # 48 bytes fit after 16, 64 do not
    assert cut(base=16) is not None and cut(base=32) is None and cut(base=2**63 - 8) is None
    assert cut(shapes=((2**62, 0),)) is None  # no bytes, but 2 * 2**62 rows overflow
    assert cut(shapes=((),)) is None and cut(shapes=((-1, 2),)) is None and cut(shapes=([4, 2],)) is not None
    narrow = torch.zeros(2, 40, dtype=torch.uint8)  # the part is aligned, a row's width (40) is not a multiple of 16
    assert cut(gathered=narrow, dtypes=(torch.complex128,), shapes=((1,),), offsets=(0,)) is None
    assert cut(gathered=shifted, shapes=((1,),), dtypes=(torch.float64,), offsets=(0,)) is None
    assert cut(dtypes=("float32",)) is None and cut(rows=(1,)) is None and cut(offsets=()) is None
