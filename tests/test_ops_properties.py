"""Properties of the fused ops over random tensors (eight dtypes, empty axes, transposed storage): split_contiguous,
scatter and transpose01 are bit-exact against dpfast.reference with contiguous outputs, and gather inverts scatter
without aliasing its input. (test_ops.py has the hand-picked cases.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpfast
from dpfast import reference

from dp_testing import same_tensor, tensors

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def split_case(draw):
    t = draw(tensors())
    dim = draw(st.integers(-t.dim(), t.dim() - 1))
    n = draw(st.integers(1, 5))
    b = t.shape[dim]
    cuts = sorted(draw(st.lists(st.integers(0, b), min_size=n - 1, max_size=n - 1)))
    sizes = [e - s for s, e in zip([0] + cuts, cuts + [b])]
    others = [t.new_zeros(tuple(s if i != dim % t.dim() else b for i, s in enumerate(t.shape))) for _ in range(2)]
    return t, dim, sizes, others


@PROPS
@given(split_case())
def test_property_split_and_scatter_bit_exact_and_gather_inverts(case):
    t, dim, sizes, others = case
    tensors_ = [t] + others
    got = dpfast.ops.split_contiguous(tensors_, dim, sizes)
    want = reference.split_contiguous(tensors_, dim, sizes)
    for row_g, row_w in zip(got, want):
        for a, b in zip(row_g, row_w):
            assert same_tensor(a, b) and a.is_contiguous()
    devices = ["cpu"] * len(sizes)
    got = dpfast.ops.scatter(tensors_, dim, sizes, devices)
    want = reference.scatter(tensors_, dim, sizes, devices)
    for row_g, row_w in zip(got, want):
        for a, b in zip(row_g, row_w):
            assert same_tensor(a, b) and a.is_contiguous()
    back = dpfast.ops.gather(got[0], dim, "cpu")
    assert same_tensor(back, t.contiguous()) and same_tensor(back, reference.gather(got[0], dim, "cpu"))
    assert back.data_ptr() != t.data_ptr() or t.numel() == 0  # never an alias of the input


@PROPS
@given(st.lists(tensors(min_dims=2), min_size=1, max_size=3))
def test_property_transpose01_bit_exact(ts):
    for a, b in zip(dpfast.ops.transpose01(*ts), reference.transpose01(*ts)):
        assert same_tensor(a, b) and a.is_contiguous()
