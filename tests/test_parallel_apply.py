"""torch's overridable ``parallel_apply`` hook, called directly: one input (and one kwargs dict) per replica, or a
clear error before anything runs, never a chunk of the batch silently dropped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls = [0]  # shared by the replicas (a shallow copy): counts every replica's call

    def forward(self, x):
        self.calls[0] += 1
        return self.lin(x)


@pytest.mark.parametrize(("n_inputs", "n_kwargs"), [(3, 0), (1, 0), (2, 3), (2, 1)])
def test_inputs_or_kwargs_that_do_not_match_the_replicas_are_refused(n_inputs, n_kwargs):
    """Was: with more inputs than replicas the extra ones were dropped (a third of the batch lost); with fewer, an
    internal IndexError blamed on a replica."""
    m = Counted()
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    replicas = dp.replicate(m, dp.device_ids)
    inputs = [(torch.randn(2, 2),) for _ in range(n_inputs)]
    kwargs = [{} for _ in range(n_kwargs)] or None
    with pytest.raises(ValueError, match=rf"parallel_apply got 2 replicas, {n_inputs} inputs and"):
        dp.parallel_apply(replicas, inputs, kwargs)
    assert m.calls == [0]


def test_one_input_per_replica_runs_them_all():
    m = Counted()
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    x = torch.randn(4, 2)
    args, kws = dp.scatter((x,), {}, dp.device_ids)
    outputs = dp.parallel_apply(dp.replicate(m, dp.device_ids), args, kws)
    torch.testing.assert_close(dp.gather(outputs, dp.output_device), m(x))
