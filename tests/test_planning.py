"""Chunk sizes, batch-size choice, the ScatterError table and plan() rendering."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dpfast
from dpfast.plan.errors import ScatterError
from dpfast.plan.splits import split_sizes, validate_chunk_sizes

# ---- chunk sizes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, n, expected",
    [
        (9, 4, [3, 2, 2, 2]),  # every device used (tensor.chunk would give 5 chunks of 3,3,3,0 -> 3 devices)
        (9, 8, [2, 1, 1, 1, 1, 1, 1, 1]),
        (8, 4, [2, 2, 2, 2]),
        (2, 5, [1, 1, 0, 0, 0]),
        (0, 3, [0, 0, 0]),
        (1, 1, [1]),
    ],
)
def test_even_split(batch, n, expected):
    assert split_sizes(batch, n) == expected


@pytest.mark.parametrize(
    "batch, weights, expected",
    [
        (7, [1, 2, 2, 2], [1, 2, 2, 2]),
        (10, [1, 0, 1], [5, 0, 5]),
        (5, [1, 1, 1], [2, 2, 1]),  # ties in the remainder go to earlier devices
        (3, [0, 1], [0, 3]),
        (10, [0.5, 1.5], [3, 7]),  # 2.5 / 7.5: the tie goes to the earlier device
        (1, [1, 3], [0, 1]),
    ],
)
def test_weighted_split(batch, weights, expected):
    assert split_sizes(batch, len(weights), validate_chunk_sizes(weights, len(weights))) == expected


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(0, 10_000), n=st.integers(1, 16))
def test_even_split_properties(batch, n):
    sizes = split_sizes(batch, n)
    assert len(sizes) == n and sum(sizes) == batch
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier devices take the remainder
    if batch >= n:
        assert min(sizes) > 0  # every device used


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(0, 10_000),
    weights=st.lists(st.one_of(st.integers(0, 8), st.floats(0, 8, allow_nan=False)), min_size=1, max_size=9).filter(
        lambda w: sum(w) > 0
    ),
)
def test_weighted_split_properties(batch, weights):
    fr = validate_chunk_sizes(weights, len(weights))
    sizes = split_sizes(batch, len(weights), fr)
    assert sum(sizes) == batch  # no sample is ever dropped
    total = sum(fr)
    for s, w in zip(sizes, fr):
        if w == 0:
            assert s == 0
        assert abs(s - Fraction(batch) * w / total) < 1  # largest remainder: within one of the exact share


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(1, 16))
def test_property_even_split_sums_and_differs_by_at_most_one(batch, n):
    sizes = split_sizes(batch, n)
    assert len(sizes) == n and sum(sizes) == batch and min(sizes) >= 0
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier devices take the remainder


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 10**6),
    st.lists(st.one_of(st.integers(0, 8), st.floats(0, 8)), min_size=1, max_size=12).filter(lambda w: sum(w) > 0),
)
def test_property_weighted_split_sums_and_is_proportional(batch, weights):
    ws = dpfast.DataParallel(nn.Identity(), ["cpu"] * len(weights), chunk_sizes=weights)._weights
    sizes = split_sizes(batch, len(weights), ws)
    assert sum(sizes) == batch and all(s >= 0 for s in sizes)
    total = sum(ws)
    for s, w in zip(sizes, ws):
        assert abs(s - batch * w / total) < 1  # largest remainder: within one of the exact share
        if w == 0:
            assert s == 0


@pytest.mark.parametrize(
    "chunk_sizes, exc, match",
    [
        ([1, 2], ValueError, r"chunk_sizes has 2 weights but there are 3 device_ids"),
        ([1, -1, 1], ValueError, r"chunk_sizes\[1\] is -1; weights must be >= 0"),
        ([0, 0, 0], ValueError, r"are all zero"),
        ([1, "2", 1], TypeError, r"chunk_sizes\[1\] is str"),
        ([1, True, 1], TypeError, r"chunk_sizes\[1\] is bool"),
        ([1, math.inf, 1], ValueError, r"must be finite"),
        (3, TypeError, r"chunk_sizes must be a sequence"),
    ],
)
def test_bad_chunk_sizes(chunk_sizes, exc, match):
    with pytest.raises(exc, match=match):
        dpfast.DataParallel(nn.Identity(), ["cpu"] * 3, chunk_sizes=chunk_sizes)


# ---- B and the ScatterError -----------------------------------------------------------------------------------


class Three(nn.Module):
    def forward(self, x, h, mask=None):
        return x


def test_scatter_error_is_value_error_and_exported():
    assert issubclass(dpfast.ScatterError, ValueError)
    assert dpfast.ScatterError is ScatterError


def test_batch_chosen_by_vote_per_argument():
    # h has two leaves of size 2 but votes once; x and mask (size 6) outvote it.
    dp = dpfast.DataParallel(Three(), ["cpu"] * 2)
    x = torch.zeros(6, 3)
    h = (torch.zeros(2, 6, 4), torch.zeros(2, 6, 4))
    with pytest.raises(ScatterError, match=r"B = 6") as info:
        dp(x, h, torch.zeros(6, 1))
    msg = str(info.value)
    for line in ("x     (6, 3)     0     0     6", "h[0]", "h[1]", "mask"):
        assert line in msg
    assert "in_dims={'h': 1}" in msg


def test_batch_tie_goes_to_first_argument():
    dp = dpfast.DataParallel(Three(), ["cpu"] * 2)
    with pytest.raises(ScatterError, match=r"B = 4") as info:
        dp(torch.zeros(4, 3), torch.zeros(5, 3))
    assert "h     (5, 3)  0     0     5     <- expected 4; no axis has size 4: replicate it with None" in str(
        info.value
    )
    assert "in_dims={'h': None}" in str(info.value)


def test_plan_table_and_no_copy():
    dp = dpfast.DataParallel(Three(), ["cpu"] * 4, in_dims={"h": 1, "mask": None})
    x = torch.randn(9, 5)
    h = (torch.randn(2, 9, 4), torch.randn(2, 9, 4))
    plan = dp.plan(x, h, mask=torch.ones(5, 5))
    assert plan.batch_size == 9 and plan.sizes == [3, 2, 2, 2]
    assert [s for _, _, s in plan.replicas] == [3, 2, 2, 2]
    text = str(plan)
    assert text.splitlines()[0] == "dpfast plan: B = 9 split [3, 2, 2, 2] over 4 replicas, output on cpu"
    assert "h[0]  (2, 9, 4)  1     (2, 3, 4)  (2, 2, 4)" in text
    assert "mask  (5, 5)     None  (5, 5)" in text
    assert repr(plan) == text


def test_plan_other_leaves_and_modes():
    dp = dpfast.DataParallel(Three(), ["cpu"] * 3, chunk_sizes=[0, 1, 1])
    plan = dp.plan(torch.randn(5, 2), [1, 2], mask=None)
    text = str(plan)
    assert plan.sizes == [0, 3, 2]
    assert "#1 cpu" in text and "#0 cpu" not in text  # device 0 is skipped
    # a list of plain numbers holds no tensor: one row, passed by reference
    assert "\n  h     list[2]  0     by reference  by reference\n" in text
    assert "dpfast plan: B = 0: one call on cpu" in str(dp.plan(torch.randn(0, 2), None))
    assert "no tensor to split" in str(dp.plan([1], "a"))
    assert "B = 1 split [0, 1, 0]" in str(dp.plan(torch.randn(1, 2), None))


def test_plan_raises_like_the_call():
    dp = dpfast.DataParallel(Three(), ["cpu"] * 2)
    with pytest.raises(ScatterError):
        dp.plan(torch.zeros(4, 3), torch.zeros(5, 4))


def test_the_call_is_checked_against_its_plan(monkeypatch):
    """conftest's autouse check runs every DataParallel call of the suite against its plan(): it counts this call,
    and it catches a plan that says other sizes than the call uses."""
    import conftest

    dp = dpfast.DataParallel(nn.Linear(3, 2), ["cpu"] * 3)
    before = conftest.PLAN_CHECKS["calls"]
    dp(torch.randn(7, 3))
    assert conftest.PLAN_CHECKS["calls"] == before + 1
    real_plan = dp.plan

    def lying_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        plan.sizes = [1, 1, 5]
        return plan

    monkeypatch.setattr(dp, "plan", lying_plan)
    with pytest.raises(AssertionError):
        dp(torch.randn(7, 3))
