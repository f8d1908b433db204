"""Regression tests for defects found in review (one test per defect, each failing before its fix)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast


def test_cpu_with_an_index_is_the_cpu():
    """'cpu:0' and torch.device('cpu', 0) name the CPU; CPU tensors report device('cpu'), so comparing against
    'cpu:0' refused every module (and suggested module.to('cpu:0'), which changes nothing)."""
    module = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    for ids in (["cpu:0", "cpu:0"], ["cpu", "cpu:0"], [torch.device("cpu", 0)] * 3):
        dp = dpfast.DataParallel(module, ids, output_device="cpu:0")
        torch.testing.assert_close(dp(x), module(x))
        assert dp.device_ids == [torch.device("cpu")] * len(ids)
        assert dp.output_device == torch.device("cpu")


def test_replica_key_error_keeps_its_type():
    """A KeyError in a replica (str(KeyError(m)) is repr(m)) came back as a RuntimeError, unlike torch's
    parallel_apply, so `except KeyError` around the call stopped working."""

    class M(nn.Module):
        def forward(self, x):
            return {"a": x}["b"]

    with pytest.raises(KeyError, match="replica 0 on cpu raised KeyError: 'b'") as e:
        dpfast.DataParallel(M(), ["cpu"] * 2)(torch.zeros(4))
    assert isinstance(e.value.__cause__, KeyError)
