"""Tensors that are not plain dense ones under a split spec: quantized tensors are split (by torch) and gathered
back exactly; sparse ones are refused by plan() and the call alike, naming the argument, the layout and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dpfast


class Identity(nn.Module):
    def forward(self, x, y=None):
        return x, y


class Dequantize(nn.Module):
    def forward(self, q):
        return q.dequantize()


def _quantized(x: torch.Tensor, per_channel_axis: int | None = None) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates creating quantized tensors
        warnings.simplefilter("ignore")
        if per_channel_axis is None:
            return torch.quantize_per_tensor(x, 0.05, 3, torch.qint8)
        n = x.shape[per_channel_axis]
        scales = torch.linspace(0.01, 0.1, n, dtype=torch.float64)
        return torch.quantize_per_channel(x, scales, torch.arange(n), per_channel_axis, torch.qint8)


SPARSE = {
    "coo": lambda x: x.to_sparse(),
    "csr": lambda x: x.to_sparse_csr(),
    "csc": lambda x: x.to_sparse_csc(),
}


@pytest.mark.parametrize("layout", sorted(SPARSE))
def test_a_sparse_tensor_under_a_split_spec_is_refused_by_plan_and_call(layout):
    """Before: plan() printed a split, then the call raised NotImplementedError from the 'SparseCPU' backend."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR/CSC are beta
        sp = SPARSE[layout](torch.eye(6))
    dp = dpfast.DataParallel(Identity(), ["cpu"] * 3)
    for call in (dp.plan, dp):
        with pytest.raises(ValueError, match=rf"`y` is a sparse tensor with layout torch.sparse_{layout}; .*to_dense"):
            call(torch.zeros(6, 2), sp)
    # replicated, it reaches every replica whole; with one device nothing is split
    x, y = dpfast.DataParallel(Identity(), ["cpu"] * 3, in_dims={"y": None}, out_dims=(0, None))(torch.zeros(6, 2), sp)
    assert y is sp
    assert dpfast.DataParallel(Identity(), ["cpu"])(torch.zeros(6, 2), sp)[1] is sp


def test_a_sparse_output_under_an_int_spec_is_a_clear_error():
    class Sparse(nn.Module):
        def forward(self, x):
            return x.to_sparse()

    with pytest.raises(TypeError, match=r"output `output` is a tensor with layout torch.sparse_coo.*out_dims None"):
        dpfast.DataParallel(Sparse(), ["cpu"] * 2)(torch.eye(4))


@pytest.mark.parametrize("axis", [0, 1])
def test_quantized_tensors_are_split_and_gathered_exactly(axis):
    """Before: NotImplementedError from the 'QuantizedCPU' backend. Chunks keep the scale and zero point, and the
    gathered tensor is the input, integer for integer."""
    q = _quantized(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).t().contiguous().t())
    dp = dpfast.DataParallel(Identity(), ["cpu"] * 3, in_dims={"x": axis}, out_dims=(axis, None))
    sizes = dp.plan(q).sizes
    assert sizes == [2, 1, 1] if axis == 0 else [2, 2, 2]
    out, _ = dp(q)
    assert out.is_quantized and (out.q_scale(), out.q_zero_point()) == (q.q_scale(), q.q_zero_point())
    assert torch.equal(out.int_repr(), q.int_repr())
    assert out.data_ptr() != q.data_ptr()


@pytest.mark.parametrize("split_axis,channel_axis", [(0, 0), (0, 1), (1, 1)])
def test_per_channel_quantized_chunks_keep_their_channels_scales(split_axis, channel_axis):
    q = _quantized(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), channel_axis)
    dp = dpfast.DataParallel(Dequantize(), ["cpu"] * 2, in_dims=split_axis, out_dims=split_axis)
    assert torch.equal(dp(q), q.dequantize())


def test_quantized_outputs_that_torch_would_requantize_are_a_clear_error():
    class PerReplicaScale(nn.Module):
        def forward(self, x):
            return torch.quantize_per_tensor(x, float(x.shape[0]) / 10, 0, torch.qint8)

    dp = dpfast.DataParallel(PerReplicaScale(), ["cpu"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"output `output` is a quantized tensor that dpfast cannot concatenate"):
            dp(torch.randn(3, 2))
