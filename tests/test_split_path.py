"""One split path: forward and torch's ``scatter`` hook split a call by the same plan (cost and chunk_sizes
included), so a subclass that overrides a hook runs what ``plan()`` says; the hook checks its device_ids."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast


class WithLengths(nn.Module):
    def forward(self, x, lengths):
        return x * 2


class GatherHook(dpfast.DataParallel):
    """Overrides one of torch's hooks, so forward runs scatter -> replicate -> parallel_apply -> gather."""

    def gather(self, outputs, output_device):
        return super().gather(outputs, output_device)


@pytest.mark.parametrize("cls", [dpfast.DataParallel, GatherHook], ids=["forward", "through-hooks"])
def test_the_hook_path_splits_by_cost_as_the_plan_says(cls):
    """Before: scatter() planned without cost, so a subclass overriding a hook split by counts while plan() said
    by cost (tests/conftest.py's check caught the call disagreeing with its plan)."""
    lengths = torch.tensor([9, 1, 1, 1, 1, 1])
    dp = cls(WithLengths(), ["cpu"] * 2, cost="lengths")
    x = torch.arange(12.0).reshape(6, 2)
    assert dp.plan(x, lengths).sizes == [1, 5]
    assert torch.equal(dp(x, lengths), x * 2)
    args, _ = dp.scatter((x, lengths), {}, dp.device_ids)
    assert [a[0].shape[0] for a in args] == [1, 5]


def test_scatter_on_other_devices_ignores_the_wrappers_weights():
    dp = dpfast.DataParallel(nn.Identity(), ["cpu"] * 2, chunk_sizes=[1, 3])
    x = torch.zeros(8, 2)
    assert [a[0].shape[0] for a in dp.scatter((x,), {}, dp.device_ids)[0]] == [2, 6]
    assert [a[0].shape[0] for a in dp.scatter((x,), {}, ["cpu"] * 4)[0]] == [2, 2, 2, 2]


def test_the_scatter_hook_with_no_devices_names_device_ids():
    """Before: ZeroDivisionError."""
    dp = dpfast.DataParallel(nn.Identity(), ["cpu"] * 2)
    for bad in ([], ()):
        with pytest.raises(ValueError, match=r"device_ids must be a non-empty sequence of devices"):
            dp.scatter((torch.zeros(4),), {}, bad)
