"""The suite's own comparison helpers (tests/dp_testing.py) can fail: assert_bitexact tells apart what a value
comparison cannot (NaN payloads, signed zeros, bool bytes) and refuses a strided or lazily negated output."""

from __future__ import annotations

import math

import pytest
import torch

from dp_testing import assert_bitexact, bits, random_bits

NAN_WITH_PAYLOAD = torch.tensor([0x7FF0000000000123], dtype=torch.int64).view(torch.float64)


@pytest.mark.parametrize(
    "actual, expected",
    [
        (torch.tensor([-0.0]), torch.tensor([0.0])),
        (NAN_WITH_PAYLOAD, torch.tensor([math.nan], dtype=torch.float64)),
        (torch.tensor([2], dtype=torch.uint8).view(torch.bool), torch.tensor([True])),
        (torch.tensor([complex(1.0, -0.0)]), torch.tensor([complex(1.0, 0.0)])),
        (torch.zeros(2, 3), torch.zeros(3, 2)),
        (torch.zeros(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float64)),
        (torch.zeros(3, 2).t(), torch.zeros(2, 3)),
        (torch._neg_view(torch.ones(3)), -torch.ones(3)),
    ],
    ids=["signed-zero", "nan-payload", "bool-byte", "complex-signed-zero", "shape", "dtype", "strided", "lazy-neg"],
)
def test_assert_bitexact_fails_on_each_difference(actual, expected):
    with pytest.raises(AssertionError):
        assert_bitexact(actual, expected)


DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_assert_bitexact_passes_on_the_same_bits(dtype):
    x = random_bits((4, 5), dtype, seed=3)  # NaNs among them: their bits compare equal although their values do not
    assert_bitexact(x.clone(), x)
    assert_bitexact(x.t().contiguous(), x.t())  # a strided expected value is compared by its logical order
    assert_bitexact(x.t(), x.t().contiguous(), contiguous=False)  # a strided destination written in place
    assert bits(x).shape == (x.shape + (2,) if dtype.is_complex else x.shape)
