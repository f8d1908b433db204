"""The test suite's one helpers module: comparing a DataParallel run with the plain module, comparing tensors bit
for bit, tensor strategies for the property tests, and the small models several test files use.

Everything is float64 (``DT``) so comparisons are tight; the vehicle is the CPU rehearsal ``device_ids=["cpu"] * n``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

import dpfast

DT = torch.float64

# ---- comparing tensors -----------------------------------------------------------------------------------------

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of its element width, in logical order and of its shape (a complex tensor:
    one more axis, real and imaginary), so that ``torch.equal`` on them also tells NaN payloads, -0.0 and bool
    bytes apart."""
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_INT_OF_WIDTH[t.element_size()])


def assert_bitexact(actual: torch.Tensor, expected: torch.Tensor, *, contiguous: bool = True) -> None:
    """``actual`` (an op's or a gather's output) is ``expected`` bit for bit: same shape, dtype and device, every
    element's bits equal, and ``actual`` a materialized tensor (no lazy conjugate or negative bit) that is
    contiguous, as every output of the fused ops is (strides of size-1 axes do not matter, as for
    ``is_contiguous``). ``contiguous=False`` is for a strided destination written in place."""
    got = (actual.shape, actual.dtype, actual.device)
    assert got == (expected.shape, expected.dtype, expected.device), (got, expected.shape, expected.dtype)
    assert not (actual.is_conj() or actual.is_neg()), "the output is a lazy conjugated or negated view"
    if contiguous:
        assert actual.is_contiguous(), f"output of shape {tuple(actual.shape)} has strides {actual.stride()}"
    assert torch.equal(bits(actual), bits(expected))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, device and values (layout not compared)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


# ---- random tensors for property tests -------------------------------------------------------------------------

PROPERTY_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
]


@st.composite
def tensors(draw, min_dims=1, max_dims=4):
    """A CPU tensor of 0 to 5 elements per axis, of one of ``PROPERTY_DTYPES``, contiguous or transposed in memory."""
    shape = draw(st.lists(st.integers(0, 5), min_size=min_dims, max_size=max_dims))
    dtype = draw(st.sampled_from(PROPERTY_DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype.is_floating_point or dtype.is_complex:
        t = (
            torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            if not dtype.is_complex
            else torch.randn(*shape, generator=g, dtype=dtype)
        )
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        t = torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    if len(shape) >= 2 and draw(st.booleans()):  # non-contiguous: same values, transposed storage
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    return t


def random_bits(shape, dtype: torch.dtype, device="cpu", seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern: NaN payloads, signed zeros, subnormals; bools 0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n * width,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


# ---- comparing a DataParallel run with the plain module ----------------------------------------------------------


def walk(obj: Any, fn):
    """Map ``fn`` over the tensor/PackedSequence leaves of tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*(walk(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(walk(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: walk(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: walk(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    return obj


def leaves_of(obj: Any) -> list:
    out: list = []
    walk(obj, lambda t: out.append(t) or t)
    return out


def fresh_inputs(obj: Any) -> Any:
    """Independent copies of the inputs; floating tensors become leaves that require grad."""

    def f(t):
        if isinstance(t, PackedSequence):
            return t  # rebuilt by the test from its own leaves
        t = t.detach().clone()
        return t.requires_grad_(True) if t.is_floating_point() else t

    return walk(obj, f)


def as_comparable(t):
    return pad_packed_sequence(t)[0] if isinstance(t, PackedSequence) else t


def weighted_loss(out: Any) -> torch.Tensor:
    """A fixed, shape-dependent weighted sum of every floating output, so each element's gradient is distinct."""
    total = torch.zeros((), dtype=DT)
    for t in leaves_of(out):
        t = as_comparable(t)
        if t.is_floating_point() and t.requires_grad:
            w = torch.arange(t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape).sin()
            total = total + (t * w).sum()
    return total


def assert_same_bits(a: Any, b: Any) -> None:
    """Two call results equal bit for bit: the same structure and types, every tensor the same shape, dtype,
    device, memory format and bits (a quantized one: its scheme, scale, zero point and integers)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor) and a.is_quantized:  # (viewing a quantized tensor's bits crashes torch)
        assert a.shape == b.shape and a.dtype == b.dtype and a.qscheme() == b.qscheme()
        assert (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point())
        assert torch.equal(a.int_repr(), b.int_repr())
    elif isinstance(a, torch.Tensor):
        assert a.is_contiguous(memory_format=torch.channels_last) == b.is_contiguous(memory_format=torch.channels_last)
        assert_bitexact(a, b, contiguous=False)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_bits(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_bits(x, y)
    else:
        assert a == b


def assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, (torch.Tensor, PackedSequence)):
        torch.testing.assert_close(as_comparable(actual), as_comparable(expected))
        return
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same(actual[k], expected[k])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(actual, f.name), getattr(expected, f.name))
    else:
        assert actual == expected


def check_against_module(factory, args, kwargs=None, n=3, expected=None, **dp_kwargs):
    """Run ``DataParallel(module, ['cpu'] * n, **dp_kwargs)`` and the plain module on copies of the same inputs;
    outputs, parameter gradients and input gradients must match. Returns the DataParallel output."""
    kwargs = kwargs or {}
    torch.manual_seed(0)
    module = factory().to(DT)
    reference = copy.deepcopy(module)
    a1, k1 = fresh_inputs((tuple(args), kwargs))
    a2, k2 = fresh_inputs((tuple(args), kwargs))
    out = dpfast.DataParallel(module, ["cpu"] * n, **dp_kwargs)(*a1, **k1)
    ref = (expected or (lambda m, *a, **k: m(*a, **k)))(reference, *a2, **k2)
    assert_same(out, ref)
    if weighted_loss(ref).requires_grad:
        weighted_loss(out).backward()
        weighted_loss(ref).backward()
        for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        for x, y in zip(leaves_of((a1, k1)), leaves_of((a2, k2))):
            if isinstance(x, torch.Tensor) and x.requires_grad and y.grad is not None:
                torch.testing.assert_close(x.grad, y.grad)
    return out


# ---- small models ------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, f_in=4, f_out=3, hidden=6):
        super().__init__()
        self.l1 = nn.Linear(f_in, hidden)
        self.l2 = nn.Linear(hidden, f_out)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class Losses(nn.Module):
    """Returns (per-sample-mean loss, sum loss, predictions)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        pred = self.lin(x)
        return F.mse_loss(pred, y), ((pred - y) ** 2).sum(), pred


class NoEmpty(Losses):
    """Refuses an empty batch (like BatchNorm in training mode does for B = 1): a rank without rows runs a ghost
    sample instead."""

    def forward(self, x, y):
        if x.shape[0] == 0:
            raise RuntimeError("NoEmpty cannot run on an empty batch")
        return super().forward(x, y)


class PackedLSTM(nn.Module):
    """A 2-layer LSTM taking a PackedSequence (and an optional state)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=2)

    def forward(self, ps, hx=None):
        return self.lstm(ps, hx)


class Counting(nn.Module):
    """Counts its calls and returns ``x``: a refused input must be refused before the module runs."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(3, 3)

    def forward(self, x, lengths=None, mask=None):
        self.calls += 1
        return x


class Contrastive(nn.Module):
    """SimCLR-style: each sample's positive is its pair in the other view, its negatives the whole batch's
    embeddings (gathered from every replica, or every rank, with dpfast.all_gather). Returns the sum of this
    replica's per-sample losses."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, a, b):
        za, zb = F.normalize(self.enc(a), dim=1), F.normalize(self.enc(b), dim=1)
        every_b = dpfast.all_gather(zb, 0)  # (B, 4): the negatives come from the whole batch
        start = sum(dpfast.all_gather(torch.tensor([za.shape[0]]), 0)[: dpfast.replica_index()].tolist())
        logits = za @ every_b.t() / 0.5
        target = torch.arange(start, start + za.shape[0], device=za.device)
        return F.cross_entropy(logits, target, reduction="sum")
