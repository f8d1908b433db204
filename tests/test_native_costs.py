"""The 128-bit cost arithmetic of the extension (``dpfast._C._exact_prefix`` and ``_balanced_bounds``) against the
Python-int reference in dpfast/plan/costs.py and dpfast/plan/splits.py: the same exact costs, the same split, and
where the numbers are too wide for 128 bits, the reference takes over. Bad arguments to the private entry points
raise."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast.ext.loader import C
from dpfast.plan import costs as _costs
from dpfast.plan import splits as _splits
from dpfast.plan.splits import WidePrefix, balanced_split, validate_chunk_sizes

pytestmark = pytest.mark.skipif(C is None, reason="the compiled extension is not loaded")


def python_costs(t):
    """The reference: the same read with the extension's arithmetic switched off."""
    saved, _costs.C = _costs.C, None
    try:
        return _costs.read_costs(t, len(t), "cost")
    finally:
        _costs.C = saved


def exact_prefix(costs) -> list[Fraction]:
    return [Fraction(p) * costs.scale for p in costs.prefix]


FLOATS = st.one_of(
    st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
    st.floats(0, 1, allow_nan=False).map(lambda x: x * 2.0**-40),  # wide exponents: sums past 64 bits
    st.sampled_from([0.0, 0.1, 0.3, 1.7, 2.0**53, 2.0**-1074, 1e16]),
    st.integers(0, 1000).map(float),
)
INTS = st.one_of(st.integers(0, 1000), st.integers(0, 2**62), st.sampled_from([0, 1, 2**63 - 1]))
WEIGHTS = st.one_of(
    st.none(),
    st.lists(st.one_of(st.integers(0, 4), st.sampled_from([0.5, 1.5, 0.1, 0.3])), min_size=2, max_size=8).filter(
        lambda w: sum(w) > 0
    ),
)


@settings(max_examples=400, deadline=None)
@given(
    values=st.one_of(st.lists(FLOATS, min_size=1, max_size=40), st.lists(INTS, min_size=1, max_size=40)),
    weights=WEIGHTS,
    n=st.integers(2, 8),
    as_list=st.booleans(),
)
def test_native_costs_and_split_equal_the_python_reference(values, weights, n, as_list):
    dtype = torch.float64 if isinstance(values[0], float) else torch.int64
    t = list(values) if as_list else torch.tensor(values, dtype=dtype)
    native, reference = _costs.read_costs(t, len(values), "cost"), python_costs(t)
    declined = C._exact_prefix(torch.tensor(values, dtype=dtype))[2] is None  # sums of 125 bits or more
    assert isinstance(native.prefix, WidePrefix) != declined
    assert exact_prefix(native) == exact_prefix(reference)
    n = len(weights) if weights is not None else n
    fr = validate_chunk_sizes(weights, n)
    sizes = balanced_split(native.prefix, n, fr)
    assert sizes == balanced_split(reference.prefix, n, fr)
    got, want = native.per_part(sizes), reference.per_part(sizes)
    assert got == want and list(map(type, got)) == list(map(type, want))


def test_float_costs_use_128_bit_sums():
    t = torch.logspace(-8, 8, 1000, dtype=torch.float64)  # 53-bit significands over 53 binary orders: 106 bits
    costs = _costs.read_costs(t, 1000, "cost")
    assert isinstance(costs.prefix, WidePrefix) and costs.prefix[-1].bit_length() > 63
    assert exact_prefix(costs)[-1] == sum(Fraction(x) for x in t.tolist())


def test_numbers_too_wide_for_128_bits_go_to_the_reference(monkeypatch):
    t = torch.tensor([2.0**-1000, 2.0**1000, 1.5, 0.25], dtype=torch.float64)
    assert C._exact_prefix(t)[2] is None
    costs = _costs.read_costs(t, 4, "cost")
    assert isinstance(costs.prefix, list) and exact_prefix(costs) == exact_prefix(python_costs(t))
    assert balanced_split(costs.prefix, 2) == [2, 2]  # 2^-1000 + 2^1000 is the least largest cost


def test_weights_too_wide_for_128_bits_go_to_the_reference(monkeypatch):
    t = torch.rand(50, dtype=torch.float64)
    costs = _costs.read_costs(t, 50, "cost")
    weights = validate_chunk_sizes([0.1, 0.7, 0.2, 1 / 3], 4)  # denominators of 2^55 and more
    calls = []
    monkeypatch.setattr(_splits, "C", type("Spy", (), {"_balanced_bounds": lambda *a: calls.append(a)}))
    sizes = balanced_split(costs.prefix, 4, weights)
    assert not calls and sizes == balanced_split(python_costs(t).prefix, 4, weights)


def test_wide_prefix_reads_like_a_list_without_numpy(monkeypatch):
    pairs = C._exact_prefix(torch.tensor([2**62, 2**62, 2**62, 3], dtype=torch.int64))[2]
    expected = [0, 2**62, 2**63, 3 * 2**62, 3 * 2**62 + 3]
    assert list(WidePrefix(pairs)) == expected == WidePrefix(pairs).ints()

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    wide = WidePrefix(pairs)
    assert list(wide) == expected and wide[-1] == expected[-1] and wide[1:3] == expected[1:3]
    with pytest.raises(IndexError):
        wide[5]


def test_exact_prefix_reports_the_first_bad_sample():
    assert C._exact_prefix(torch.tensor([1.0, float("nan"), -1.0], dtype=torch.float64))[:2] == (1, None)
    assert C._exact_prefix(torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64))[0] == 2
    assert C._exact_prefix(torch.tensor([3, -1], dtype=torch.int64))[0] == 1
    assert C._exact_prefix(torch.tensor([float("inf")], dtype=torch.float64))[0] == 0
    bad, exp, pairs = C._exact_prefix(torch.tensor([0.5, 0.0, -0.0], dtype=torch.float64))
    assert (bad, exp) == (-1, -1) and pairs[:, 1].tolist() == [0, 1, 1, 1]


def _pairs(values):
    """128-bit values as the (high, low) int64 halves _exact_prefix returns."""
    return torch.tensor([[v >> 64, (v & (2**64 - 1)) - (2**64 if v & 2**63 else 0)] for v in values])


GOOD = (_pairs([0, 5, 9, 12]), [1, 1], [2, 3], 0, 6, 0, 12)  # costs 5, 4, 3 over two devices; lo 6, hi 12


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({0: torch.zeros(4, 3, dtype=torch.int64)}, ValueError, "shape"),
        ({0: torch.zeros(2, 4, dtype=torch.int64).t()}, ValueError, "contiguous"),
        ({0: _pairs([0, 5, 9, 12]).double()}, ValueError, "int64"),
        ({0: _pairs([1, 5, 9, 12])}, ValueError, "start at 0"),
        ({0: _pairs([0, 9, 5, 12])}, ValueError, "never decrease"),
        ({0: _pairs([0, 2**126])}, ValueError, "out of range"),
        ({0: "prefix"}, TypeError, "Tensor"),
        ({1: [1, 0]}, ValueError, "mult"),
        ({1: [1]}, ValueError, "one entry per device"),
        ({0: _pairs([0, 2**100, 2**100 + 1, 2**100 + 2]), 1: [2**40, 1]}, ValueError, "2\\^126"),
        ({2: [3, 2]}, ValueError, "targets"),
        ({2: [2, 4]}, ValueError, "targets"),
        ({2: "23"}, TypeError, "list or tuple"),
        ({3: -1}, ValueError, "lo"),
        ({3: 2**62}, ValueError, "lo"),
        ({5: 2**62}, ValueError, "hi"),
        ({4: 13}, ValueError, "bracket"),
        ({4: 1.5}, TypeError, "ints"),
        ({1: [2**63, 1]}, ValueError, "mult is out of range"),
        ({2: [2**64, 3]}, ValueError, "targets is out of range"),
        ({3: 2**63}, ValueError, "lo is out of range"),
        ({4: 2**64}, ValueError, "lo is out of range"),
        ({4: -1}, ValueError, "lo is out of range"),
        ({0: torch._efficientzerotensor((4, 2), dtype=torch.int64)}, ValueError, "zero-tensor"),
        ({0: torch._neg_view(_pairs([0, 5, 9, 12]))}, ValueError, "negated"),
    ],
)
def test_balanced_bounds_rejects_bad_arguments(change, exc, match):
    args = list(GOOD)
    for i, v in change.items():
        args[i] = v
    with pytest.raises(exc, match=match):
        C._balanced_bounds(*args)
    # the good arguments give the reference's boundaries: [5 | 4, 3], the largest cost 7
    assert C._balanced_bounds(*GOOD) == _splits._search([0, 5, 9, 12], [1, 1], [2, 3], 6, 12) == [0, 1, 3]


@pytest.mark.parametrize(
    "bad",
    [
        "x",
        torch.zeros(2, 2, dtype=torch.float64),
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(4, dtype=torch.float64)[::2],
        torch.zeros(3, dtype=torch.float64, device="meta"),
    ],
    ids=["str", "2-D", "int32", "strided", "meta"],
)
def test_exact_prefix_rejects_bad_arguments(bad):
    with pytest.raises((TypeError, ValueError)):
        C._exact_prefix(bad)
    with pytest.raises(TypeError):
        C._exact_prefix()


def test_negated_views_and_zero_tensors_read_as_their_values():
    """A negated view (``z.conj().imag`` is one) holds its values negated in memory; a zero tensor has no memory."""
    neg = torch._neg_view(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="cost: sample 0 has cost -1.0; costs must be >= 0"):
        _costs.read_costs(neg, 3, "cost")
    with pytest.raises(ValueError, match="negated"):
        C._exact_prefix(neg)
    positive = torch._neg_view(torch.tensor([-1, -2, -3]))
    assert exact_prefix(_costs.read_costs(positive, 3, "cost")) == [0, 1, 3, 6]
    zeros = torch._efficientzerotensor(4, dtype=torch.float64)
    assert exact_prefix(_costs.read_costs(zeros, 4, "cost")) == [0] * 5
    with pytest.raises(ValueError, match="zero-tensor"):
        C._exact_prefix(zeros)


def test_exact_prefix_refuses_a_tensor_past_its_storage():
    t = torch.ones(1000, dtype=torch.float64)
    t.untyped_storage().resize_(8)
    with pytest.raises(ValueError, match="past its storage"):
        C._exact_prefix(t)
