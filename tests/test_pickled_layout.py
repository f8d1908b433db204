"""A DataParallel saved whole (``torch.save(model)``) by an earlier dpfast layout still loads and computes the same.

The fixture was written at the last commit with the flat private modules (tests/fixtures/make_flat_layout_pickle.py
says how); its pickle names ``dpfast._binding``, ``dpfast._replicas``, ``dpfast._sync_batchnorm``, ...
"""

from __future__ import annotations

import copy
import io
import pathlib
import sys

import pytest
import torch

import dpfast

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture
def saved():
    sys.path.insert(0, str(FIXTURES))
    try:
        yield torch.load(FIXTURES / "data_parallel_flat_layout.pt", weights_only=False)
    finally:
        sys.path.remove(str(FIXTURES))
        sys.modules.pop("flat_layout_models", None)


def _bits_equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _bits_equal(x, y)


def _expected_here(saved):
    """What the saved model computes on this machine through a DataParallel of today's layout, checked against the
    output saved with it. CPU kernels differ in the last bits between processors (the fixture was made on another
    one), so the loaded wrapper is held to this bit for bit, and this to the saved output to float64 rounding."""
    dp = saved["model"]
    fresh = dpfast.DataParallel(
        copy.deepcopy(dp.module), ["cpu"] * 2, in_dims={"h": 0}, out_dims=(0, 0), chunk_sizes=[1, 2], cost="lengths"
    )
    with torch.no_grad():
        here = fresh(*saved["inputs"])
    torch.testing.assert_close(here, saved["expected"], rtol=1e-12, atol=1e-12)
    return here


def test_flat_layout_pickle_loads_and_computes_the_same(saved):
    dp = saved["model"]
    assert isinstance(dp, dpfast.DataParallel) and isinstance(dp, torch.nn.DataParallel)
    assert dp.device_ids == [torch.device("cpu")] * 2 and dp.in_dims == {"h": 0} and dp.cost == "lengths"
    assert dp.out_dims == (0, 0) and list(dp.chunk_sizes) == [1, 2]  # what _expected_here builds afresh
    x, lengths, h = saved["inputs"]
    expected = _expected_here(saved)
    with torch.no_grad():
        _bits_equal(dp(x, lengths, h), expected)
    state = dp.state_dict()
    assert list(state) == list(saved["state"])
    for k, v in saved["state"].items():
        assert torch.equal(state[k], v), k
    # and it trains: the replicas are rebuilt in the new layout
    out, _ = dp(x, lengths, h)
    out.sum().backward()
    assert all(p.grad is not None for p in dp.parameters())
    assert str(dp.plan(x, lengths, h)).startswith("dpfast plan: B = 6 split")


def test_flat_layout_pickle_saves_again(saved):
    buf = io.BytesIO()
    torch.save(saved["model"], buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    x, lengths, h = saved["inputs"]
    expected = _expected_here(saved)
    with torch.no_grad():
        _bits_equal(again(x, lengths, h), expected)
