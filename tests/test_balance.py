"""Balanced work, not balanced counts: ``cost=`` on DataParallel, its exact split, its plan() and its errors.

The split is checked against a brute-force optimum computed with exact fractions, so float costs and weights are held
to the true sums, not to float-rounded ones.
"""

from __future__ import annotations

import copy
import itertools
from collections import namedtuple
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import dpfast
from dpfast.distributed import shard_batch
from dpfast.plan.splits import balanced_split, split_sizes, validate_chunk_sizes

from dp_testing import DT, PackedLSTM, check_against_module

ISSUE_LENGTHS = [50, 40, 30, 20, 10, 10, 10, 10, 5, 5, 5, 5]


class Lengths(nn.Module):
    """A per-sample module whose forward takes the costs as an argument."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, lengths=None):
        return self.lin(x)


def plan_sizes(costs, n=4, chunk_sizes=None, **call):
    dp = dpfast.DataParallel(Lengths(), ["cpu"] * n, cost="lengths", chunk_sizes=chunk_sizes)
    return dp.plan(torch.zeros(len(costs), 3), costs, **call)


# ---- a brute-force oracle over exact fractions -------------------------------------------------------------------


def exact(c) -> Fraction:
    return Fraction(c) if not isinstance(c, Fraction) else c


def worst(costs, sizes, weights) -> Fraction:
    """The largest device cost relative to its weight (weights may be None: all 1)."""
    out, start = Fraction(0), 0
    for j, s in enumerate(sizes):
        seg = sum((exact(c) for c in costs[start : start + s]), Fraction(0))
        start += s
        w = Fraction(1) if weights is None else weights[j]
        if w == 0:
            assert s == 0, "a weight-0 device got samples"
            continue
        out = max(out, seg / w)
    return out


def brute_force(costs, n, weights) -> Fraction:
    batch = len(costs)
    active = [j for j in range(n) if weights is None or weights[j] > 0]
    best = None
    for cuts in itertools.combinations_with_replacement(range(batch + 1), len(active) - 1):
        bounds = (0,) + cuts + (batch,)
        sizes = [0] * n
        for j, a, b in zip(active, bounds, bounds[1:]):
            sizes[j] = b - a
        w = worst(costs, sizes, weights)
        best = w if best is None else min(best, w)
    return best


# ---- the issue's example and the edge cases -----------------------------------------------------------------------


def test_sorted_lengths_example_reaches_the_optimum():
    plan = plan_sizes(ISSUE_LENGTHS)
    assert split_sizes(12, 4) == [3, 3, 3, 3]
    assert plan.balance.count_costs == [120, 40, 25, 15]
    assert max(plan.balance.costs) == 60 == brute_force(ISSUE_LENGTHS, 4, None)
    # two splits reach 60 ([1, 1, 3, 7] and [1, 1, 2, 8]); the tie goes to the one whose boundaries are closest to
    # the count split's, device by device
    assert plan.sizes == [1, 1, 3, 7]
    assert plan.balance.costs == [50, 40, 60, 50]
    assert plan.balance.imbalance == pytest.approx(60 / 50)
    assert plan.balance.count_imbalance == pytest.approx(120 / 50)


def test_plan_prints_costs_and_the_count_split():
    text = str(plan_sizes(torch.tensor(ISSUE_LENGTHS)))
    lines = text.splitlines()
    assert lines[0] == "dpfast plan: B = 12 split [1, 1, 3, 7] by cost over 4 replicas, output on cpu"
    assert lines[1] == "  cost lengths per device: [50, 40, 60, 50], largest/mean 1.20"
    assert lines[2] == "  the count split [3, 3, 3, 3] would cost [120, 40, 25, 15], largest/mean 2.40"
    assert "x        (12, 3)  0     (1, 3)  (1, 3)  (3, 3)  (7, 3)" in text


def test_plan_says_when_the_count_split_is_already_optimal():
    lines = str(plan_sizes([1, 1, 1, 1, 1, 1], n=3)).splitlines()
    assert lines[0] == "dpfast plan: B = 6 split [2, 2, 2] by cost over 3 replicas, output on cpu"
    assert lines[2] == "  the count split [2, 2, 2] is the same (cost [2, 2, 2], largest/mean 1.00)"


def test_weights_are_respected_exactly():
    weights = [1, 2, 2]
    plan = plan_sizes(ISSUE_LENGTHS, n=3, chunk_sizes=weights)
    fr = validate_chunk_sizes(weights, 3)
    assert worst(ISSUE_LENGTHS, plan.sizes, fr) == brute_force(ISSUE_LENGTHS, 3, fr)
    # 50 / 1, 100 / 2, 50 / 2: device 0 carries half the others' work; the count split [2, 5, 5] reaches 90 / 1
    assert plan.sizes == [1, 4, 7]
    assert plan.balance.count_sizes == [2, 5, 5] and plan.balance.count_costs == [90, 80, 30]
    assert plan.balance.imbalance == pytest.approx(50 / 40) and plan.balance.count_imbalance == pytest.approx(90 / 40)
    assert "relative to chunk_sizes" in str(plan)


def test_weight_zero_devices_get_nothing():
    plan = plan_sizes(ISSUE_LENGTHS, n=4, chunk_sizes=[1, 0, 1, 1])
    assert plan.sizes[1] == 0 and sum(plan.sizes) == 12
    fr = validate_chunk_sizes([1, 0, 1, 1], 4)
    assert worst(ISSUE_LENGTHS, plan.sizes, fr) == brute_force(ISSUE_LENGTHS, 4, fr) == 80
    assert "#1" not in str(plan).splitlines()[3]  # the skipped device has no column


def test_ties_are_deterministic_and_prefer_the_count_split():
    # any [1, a, b] with a + b = 5 reaches 6; the count split's boundaries are 2 and 4: the first cannot stay (the
    # 6 must be alone), the second can
    assert plan_sizes([6, 1, 1, 1, 1, 1], n=3).sizes == [1, 3, 2]
    # [2, 3] and [3, 2] both reach 5 and [3, 2] is the count split
    assert plan_sizes([3, 1, 1, 1, 3], n=2).sizes == [3, 2]
    assert len({tuple(plan_sizes([6, 1, 1, 1, 1, 1], n=3).sizes) for _ in range(5)}) == 1


@pytest.mark.parametrize("batch", range(0, 26))
@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_equal_costs_give_the_count_split(batch, n):
    for c in (1, 7, 0.25):
        plan = plan_sizes([c] * batch, n=n)
        assert plan.sizes == split_sizes(batch, n)


def test_zero_costs():
    assert plan_sizes([0] * 9, n=4).sizes == [3, 2, 2, 2]  # nothing to balance: the count split
    assert plan_sizes([0, 0, 9, 0, 0, 0], n=3).sizes == [2, 2, 2]  # the count split is optimal already
    plan = plan_sizes([9, 9, 0, 0, 0, 0, 0, 0], n=2)
    assert plan.sizes == [1, 7] and plan.balance.costs == [9, 9]
    assert plan.balance.imbalance == pytest.approx(1.0)
    zero = plan_sizes([0.0] * 5, n=2)
    assert zero.balance.imbalance == 1.0 and zero.balance.count_imbalance == 1.0


def test_batch_smaller_than_devices():
    assert plan_sizes([5, 1], n=4).sizes == [1, 1, 0, 0]
    assert plan_sizes([5], n=4).sizes == [1, 0, 0, 0]
    assert plan_sizes([1, 1, 10], n=4).sizes == [1, 1, 1, 0]
    assert plan_sizes([5, 1], n=4, chunk_sizes=[0, 1, 1, 1]).sizes == [0, 1, 1, 0]


def test_one_huge_sample():
    plan = plan_sizes([100] + [1] * 7, n=4)
    assert plan.sizes == [1, 3, 2, 2] and max(plan.balance.costs) == 100
    mid = [1, 1, 1, 10**30, 1, 1, 1, 1]  # Python ints beyond int64 stay exact
    plan = plan_sizes(mid, n=3)
    assert plan.sizes == [3, 1, 4] and max(plan.balance.costs) == 10**30 == brute_force(mid, 3, None)


def test_float_costs_are_compared_exactly():
    # float prefix sums round 2**53 + 1 to 2**53, so the count split [2**53, 1 | 1] looks as good as [2**53 | 1, 1]
    # (and a tie would keep the count split); exactly, it is one heavier
    costs = [2.0**53, 1.0, 1.0]
    plan = plan_sizes(torch.tensor(costs, dtype=torch.float64), n=2)
    assert worst(costs, plan.sizes, None) == brute_force(costs, 2, None) == 2**53
    assert plan.sizes == [1, 2] and plan.balance.count_sizes == [2, 1]
    # non-integral floats: the oracle's sums are exact rationals
    tenths = [0.1, 0.2, 0.3, 0.1, 0.7, 0.3, 0.3]
    for form in (tenths, torch.tensor(tenths, dtype=torch.float64), np.array(tenths)):
        plan = plan_sizes(form, n=3)
        assert worst(tenths, plan.sizes, None) == brute_force(tenths, 3, None)


def test_balanced_split_on_prefix_sums():
    assert balanced_split([0, 50, 90, 120, 140, 150, 160, 170, 180, 185, 190, 195, 200], 4) == [1, 1, 3, 7]
    assert balanced_split([0], 3) == [0, 0, 0]
    assert balanced_split([0, 4, 4, 4], 1) == [3]


COSTS = st.one_of(
    st.integers(0, 20),
    st.floats(0, 1e3, allow_nan=False),
    st.sampled_from([0, 0.1, 0.2, 0.3, 1e16, 2.0**-30, 2.0**53, 7]),
)
WEIGHTS = st.one_of(
    st.none(),
    st.lists(st.one_of(st.integers(0, 3), st.sampled_from([0.5, 1.5, 0.1])), min_size=1, max_size=4).filter(
        lambda w: sum(w) > 0
    ),
)


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(COSTS, min_size=0, max_size=8), weights=WEIGHTS, n=st.integers(1, 4), form=st.integers(0, 2))
def test_split_is_the_brute_force_optimum(costs, weights, n, form):
    if weights is not None:
        n = len(weights)
    fr = validate_chunk_sizes(weights, n)
    if form == 1:
        costs_in = torch.tensor(costs, dtype=torch.float64)
    elif form == 2:
        costs_in = tuple(costs)
    else:
        costs_in = list(costs)
    dp = dpfast.DataParallel(Lengths(), ["cpu"] * n, cost="lengths", chunk_sizes=weights)
    x = torch.zeros(len(costs), 3)
    if n == 1:
        return  # one device: called directly, nothing split
    plan = dp.plan(x, costs_in)
    if not costs:
        assert plan.mode == "once"
        return
    assert sum(plan.sizes) == len(costs) and len(plan.sizes) == n
    assert worst(costs, plan.sizes, fr) == brute_force(costs, n, fr)
    count = split_sizes(len(costs), n, fr)
    if worst(costs, count, fr) == worst(costs, plan.sizes, fr):
        assert plan.sizes == count  # ties go to the count split when it is optimal
    assert dp.plan(x, costs_in).sizes == plan.sizes  # deterministic


class Scaled(nn.Module):
    """Per sample: a small MLP of x, scaled by the sample's length (so the costs are also an input)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x, lengths):
        return self.out(torch.tanh(self.lin(x))) * lengths.unsqueeze(1).to(x.dtype), lengths.sum()


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12), n=st.integers(2, 4))
def test_outputs_and_gradients_equal_the_plain_module(lengths, n):
    lengths = sorted(lengths, reverse=True)
    x = torch.randn(len(lengths), 3, dtype=DT)
    check_against_module(Scaled, (x, torch.tensor(lengths)), n=n, cost="lengths", out_dims=(0, "sum"))


# ---- where the costs come from -----------------------------------------------------------------------------------


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_packed_lstm_split_by_its_sequence_lengths(enforce_sorted):
    lengths = [9, 7, 6, 3, 2, 2, 1, 1, 1] if enforce_sorted else [1, 9, 2, 7, 1, 6, 3, 2, 1]
    torch.manual_seed(0)
    seqs = [torch.randn(k, 3, dtype=DT) for k in lengths]
    module = PackedLSTM().to(DT)
    reference = copy.deepcopy(module)
    dp = dpfast.DataParallel(module, ["cpu"] * 3, in_dims={"hx": 1}, out_dims=(0, 1), cost="ps")

    s1 = [s.clone().requires_grad_(True) for s in seqs]
    s2 = [s.clone().requires_grad_(True) for s in seqs]
    ps = pack_sequence(s1, enforce_sorted=enforce_sorted)
    plan = dp.plan(ps)
    assert plan.sizes == ([1, 2, 6] if enforce_sorted else [3, 2, 4])
    assert max(plan.balance.costs) == brute_force(lengths, 3, None)
    out, (h, c) = dp(ps)
    ref_out, (ref_h, ref_c) = reference(pack_sequence(s2, enforce_sorted=enforce_sorted))
    assert isinstance(out, PackedSequence)
    padded, lens = pad_packed_sequence(out)
    ref_padded, _ = pad_packed_sequence(ref_out)
    assert lens.tolist() == lengths
    torch.testing.assert_close(padded, ref_padded)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(c, ref_c)
    w = torch.arange(padded.numel(), dtype=DT).reshape(padded.shape).sin()
    ((padded * w).sum() + h.sum() + c.pow(2).sum()).backward()
    ((ref_padded * w).sum() + ref_h.sum() + ref_c.pow(2).sum()).backward()
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a.grad, b.grad)


Batch = namedtuple("Batch", "x lengths")


class Structured(nn.Module):
    def forward(self, batch, *rest, scale=1.0, **extra):
        return batch["x"] * scale if isinstance(batch, dict) else batch.x * scale


@pytest.mark.parametrize(
    "cost, make",
    [
        ("batch['lengths']", lambda x, ln: ((dict(x=x, lengths=ln),), {})),
        ('batch["lengths"]', lambda x, ln: ((dict(x=x, lengths=ln),), {})),
        ("batch['meta'][1]", lambda x, ln: ((dict(x=x, meta=("id", ln)),), {})),
        ("batch.lengths", lambda x, ln: ((Batch(x, ln),), {})),
        ("batch[1]", lambda x, ln: ((Batch(x, ln),), {})),
        ("rest[0]", lambda x, ln: ((dict(x=x), ln), {})),
        ("extra['lens']", lambda x, ln: ((dict(x=x),), {"lens": ln})),
        ("lens", lambda x, ln: ((dict(x=x),), {"lens": ln})),  # any keyword when forward takes **kwargs
        (lambda batch, *r, **k: torch.as_tensor(batch["lengths"]) * 2, lambda x, ln: ((dict(x=x, lengths=ln),), {})),
    ],
)
@pytest.mark.parametrize("form", [list, torch.tensor, np.array])
def test_cost_paths_and_callables(cost, make, form):
    x = torch.randn(12, 3, dtype=DT)
    args, kwargs = make(x, form(ISSUE_LENGTHS))
    dp = dpfast.DataParallel(Structured(), ["cpu"] * 4, cost=cost)
    assert dp.plan(*args, **kwargs).sizes == [1, 1, 3, 7]
    torch.testing.assert_close(dp(*args, **kwargs), x)


def test_cost_by_position_or_keyword_alike():
    dp = dpfast.DataParallel(Lengths(), ["cpu"] * 4, cost="lengths")
    x = torch.zeros(12, 3)
    assert dp.plan(x, ISSUE_LENGTHS).sizes == dp.plan(x, lengths=ISSUE_LENGTHS).sizes == [1, 1, 3, 7]


def test_integer_and_float_tensors_of_any_dtype():
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert plan_sizes(torch.tensor(ISSUE_LENGTHS, dtype=dtype)).sizes == [1, 1, 3, 7], dtype
    big = torch.tensor([2**61, 2**61, 2**61, 2**61, 1], dtype=torch.int64)  # their sum overflows int64
    plan = plan_sizes(big, n=2)
    assert plan.balance.costs == [2**62, 2**62 + 1]
    tiny = torch.tensor([2.0**-1000, 2.0**1000, 1.5, 2.0**-1074], dtype=torch.float64)  # 2100 bits apart: exact
    assert worst(tiny.tolist(), plan_sizes(tiny, n=2).sizes, None) == brute_force(tiny.tolist(), 2, None)


def test_costs_without_numpy(monkeypatch):
    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    expected = plan_sizes(torch.tensor(ISSUE_LENGTHS)).sizes
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert plan_sizes(torch.tensor(ISSUE_LENGTHS)).sizes == expected == [1, 1, 3, 7]
    assert plan_sizes(torch.tensor(ISSUE_LENGTHS) * 0.1).sizes == expected


def test_one_device_and_empty_batch():
    assert dpfast.DataParallel(Lengths(), ["cpu"], cost="lengths").plan(torch.zeros(3, 3), "ignored").mode == "direct"
    plan = plan_sizes(torch.zeros(0, dtype=torch.int64))
    assert plan.mode == "once" and plan.sizes == [0, 0, 0, 0]


def test_shard_batch_takes_the_balanced_share():
    lengths = torch.tensor(ISSUE_LENGTHS)
    batch = {"x": torch.arange(12), "lengths": lengths}
    parts = [shard_batch(batch, r, 4, cost="batch['lengths']") for r in range(4)]
    assert [len(p["x"]) for p in parts] == [1, 1, 3, 7]
    assert torch.cat([p["x"] for p in parts]).tolist() == list(range(12))
    assert shard_batch(batch, 0, 4, cost=lambda b: b["lengths"])["x"].tolist() == [0]
    with pytest.raises(ValueError, match=r"cost=\"batch\['lengths'\]\" has 3 values but B = 12"):
        shard_batch(dict(batch, lengths=[1, 2, 3]), 0, 4, cost="batch['lengths']")


# ---- bad costs: refused before anything is copied or run ---------------------------------------------------------


@pytest.mark.parametrize(
    "cost, exc, match",
    [
        ("lens", TypeError, r"cost='lens' names no parameter of .*forward\(x, lengths=None\); known names: x, lengths"),
        (3, TypeError, r"cost must be the name of a forward parameter .* or a callable .*; got int 3"),
        (torch.ones(3), TypeError, r"cost must be the name .* got Tensor"),
        ("lengths[", ValueError, r"cost='lengths\[' is not a path"),
        ("lengths[1:2]", ValueError, r"cost='lengths\[1:2\]' is not a path"),
        ("x + 1", ValueError, r"cost='x \+ 1' is not a path"),
        ("", ValueError, r"cost='' is not a path"),
    ],
)
def test_bad_cost_at_construction(cost, exc, match):
    with pytest.raises(exc, match=match):
        dpfast.DataParallel(Lengths(), ["cpu"] * 2, cost=cost)
    with pytest.raises(exc, match=match):
        dpfast.DistributedDataParallel(Lengths(), cost=cost)  # before torch.distributed is even needed


class Spy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x, lengths=None, batch=None):
        self.calls += 1
        return self.lin(x)


MISSING = object()


@pytest.mark.parametrize(
    "cost, lengths, exc, match",
    [
        ("lengths", [1, 2, 3], ValueError, r"cost='lengths' has 3 values but B = 4 .*one cost per sample"),
        ("lengths", torch.ones(5), ValueError, r"cost='lengths' has 5 values but B = 4"),
        ("lengths", (1, 2, 3, 4, 5), ValueError, r"cost='lengths' has 5 values but B = 4"),
        ("lengths", [1, -2, 3, 4], ValueError, r"cost='lengths': sample 1 has cost -2; costs must be >= 0"),
        ("lengths", torch.tensor([1.0, 2, -0.5, 1]), ValueError, r"sample 2 has cost -0.5; costs must be >= 0"),
        ("lengths", [1, float("nan"), 3, 4], ValueError, r"sample 1 has cost nan; costs must be finite"),
        ("lengths", torch.tensor([1, 2, 3, float("inf")]), ValueError, r"sample 3 has cost inf; costs must be fin"),
        ("lengths", ["a", "b", "c", "d"], TypeError, r"cost='lengths': sample 0 is str 'a'; costs are numbers"),
        ("lengths", [1, True, 3, 4], TypeError, r"sample 1 is bool True; costs are numbers"),
        ("lengths", torch.ones(4, dtype=torch.bool), TypeError, r"cost='lengths' is a bool tensor"),
        ("lengths", torch.ones(4, dtype=torch.complex64), TypeError, r"cost='lengths' is a complex64 tensor"),
        ("lengths", torch.ones(4, 2), TypeError, r"cost='lengths' is a Tensor of shape \(4, 2\); costs are one"),
        ("lengths", torch.tensor(4), TypeError, r"cost='lengths' is a Tensor of shape \(\)"),
        ("lengths", None, TypeError, r"cost='lengths' is None; costs are one number per sample"),
        ("lengths", {"a": 1}, TypeError, r"cost='lengths' is a dict"),
        ("lengths", "abcd", TypeError, r"cost='lengths' is a str"),
        ("batch['n']", MISSING, ValueError, r"cost=\"batch\['n'\]\", but this call does not pass `batch`"),
        ("lengths[0]", [[1, 2, 3]], ValueError, r"cost='lengths\[0\]' has 3 values but B = 4"),
        ("lengths['n']", [1, 2, 3, 4], ValueError, r"`lengths` is a list of length 4, which has no key 'n'"),
        ("lengths.n", [1, 2, 3, 4], ValueError, r"`lengths` is a list of length 4, which has no field 'n'"),
        (lambda x, lengths: lengths[:2], [1, 2, 3, 4], ValueError, r"cost=<lambda> has 2 values but B = 4"),
        (lambda x: x, [1, 2, 3, 4], TypeError, r"cost=<lambda> raised TypeError: .*takes 1 positional argument"),
        (lambda x, lengths: {}["k"], [1, 2, 3, 4], ValueError, r"cost=<lambda> raised KeyError: 'k'"),
    ],
)
def test_bad_costs_raise_before_anything_is_copied_or_run(cost, lengths, exc, match, monkeypatch):
    from dpfast import data_parallel

    def no_scatter(*args, **kwargs):
        raise AssertionError("scattered")

    monkeypatch.setattr(data_parallel, "scatter_tree", no_scatter)
    module = Spy()
    dp = dpfast.DataParallel(module, ["cpu"] * 2, in_dims={"lengths": None}, cost=cost)  # costs not split
    args = (torch.zeros(4, 3),) if lengths is MISSING else (torch.zeros(4, 3), lengths)
    with pytest.raises(exc, match=match):
        dp.plan(*args)
    with pytest.raises(exc, match=match):
        dp(*args)
    assert module.calls == 0


def test_costs_on_meta_are_refused():
    dp = dpfast.DataParallel(Lengths(), ["cpu"] * 2, cost=lambda x, lengths=None: torch.ones(len(x), device="meta"))
    with pytest.raises(TypeError, match=r"cost=<lambda> is on meta; its values are needed"):
        dp.plan(torch.zeros(4, 3))
