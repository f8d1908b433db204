"""Extreme values and sizes through DataParallel: NaN (with its payload), ±inf, -0.0 and subnormals arrive bit for bit;
axes of size 0 and a batch of 0; batches too large to allocate are planned, and split sizes past 2^62 add up."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dpfast
from dpfast.plan.splits import split_sizes

from dp_testing import Counting, bits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_and_inf_pass_through_bit_exact(dtype):
    x = torch.tensor(
        [
            [math.nan, -math.nan],
            [math.inf, -math.inf],
            [-0.0, 0.0],
            [1e-40, -1e-40],
            [3.0, 1.0],
            [math.nan, 7.0],
            [math.inf, math.nan],
        ],
        dtype=torch.float64,
    ).to(dtype)
    x[0, 0] = torch.tensor(0x7FF0000000000123, dtype=torch.int64).view(torch.float64).to(dtype)  # a payload NaN
    mask = torch.tensor([math.nan, math.inf], dtype=dtype)

    class M(nn.Module):
        def forward(self, x, mask):
            return x, mask, x.t()

    dp = dpfast.DataParallel(M(), ["cpu"] * 3, in_dims={"mask": None}, out_dims=(0, None, 1))
    out, m, xt = dp(x, mask)
    assert torch.equal(bits(out), bits(x)) and torch.equal(bits(m), bits(mask))
    assert torch.equal(bits(xt), bits(x.t()))


def test_zero_size_dims():
    dp = dpfast.DataParallel(nn.Identity(), ["cpu"] * 3)
    for shape in [(7, 0), (7, 0, 3), (5, 2, 0)]:
        x = torch.randn(*shape)
        assert dp(x).shape == x.shape
    module = Counting()
    out = dpfast.DataParallel(module, ["cpu"] * 3)(torch.zeros(0, 3))  # B == 0: one call on device_ids[0]
    assert out.shape == (0, 3) and module.calls == 1
    assert "B = 0" in str(dpfast.DataParallel(module, ["cpu"] * 3).plan(torch.zeros(0, 3)))
    out = dpfast.DataParallel(nn.Identity(), ["cpu"] * 3, dim=1)(torch.zeros(0, 5))  # B = 5, rows of size 0
    assert out.shape == (0, 5)


def test_huge_dims():
    n = 7
    x = torch.arange(2**20 + 3, dtype=torch.int32)
    assert torch.equal(dpfast.DataParallel(nn.Identity(), ["cpu"] * n)(x), x)
    plan = dpfast.DataParallel(nn.Identity(), ["cpu"] * n).plan(torch.zeros(1, 3).expand(2**40, 3))
    assert sum(plan.sizes) == 2**40 and max(plan.sizes) - min(plan.sizes) <= 1  # planned, nothing allocated
    sizes = split_sizes(2**62 + 5, 5, [1, 2, 2, 2, 0])
    assert sum(sizes) == 2**62 + 5 and sizes[-1] == 0
