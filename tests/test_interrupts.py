"""A KeyboardInterrupt (any BaseException that is not an Exception) stops a DataParallel call at once: no replica
starts after it, it reaches the caller as it was raised, and the next call works. Simulated deterministically by a
replica that raises it (no real signals)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast

pytestmark = pytest.mark.usefixtures("one_thread")


class Interrupted(nn.Module):
    """Replica ``at`` raises ``error`` (once); every replica records that it started; ``collective`` makes the
    replicas meet at an all_reduce first (so they take turns on worker threads)."""

    def __init__(self, error, at=1, collective=False):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.error, self.at, self.collective = error, at, collective
        self.started = []  # shared by the replicas: a list is not copied

    def forward(self, x):
        i = dpfast.replica_index()
        self.started.append(i)
        if i == self.at and self.error is not None:
            error, self.__dict__["error"] = self.error, None
            raise error
        if self.collective:
            x = x + dpfast.all_reduce(x.sum()) * 0
        return self.lin(x)


@pytest.mark.parametrize("collective", [False, True])
def test_an_interrupt_in_replica_1_of_4_starts_no_other_replica(collective):
    """Was: replicas 2 and 3 still started, and the interrupt surfaced after them."""
    interrupt = KeyboardInterrupt()
    m = Interrupted(interrupt, at=1, collective=collective)
    dp = dpfast.DataParallel(m, ["cpu"] * 4)
    with pytest.raises(KeyboardInterrupt) as info:
        dp(torch.randn(8, 2))
    assert info.value is interrupt  # as it was raised, not wrapped
    assert 2 not in m.started and 3 not in m.started
    m.error = None  # the module's own attribute: the next call's replicas take it
    m.started.clear()
    x = torch.randn(8, 2)
    torch.testing.assert_close(dp(x), m.lin(x))
    assert sorted(m.started) == [0, 1, 2, 3]


def test_an_interrupt_in_the_module_itself_stops_the_call():
    m = Interrupted(KeyboardInterrupt(), at=0)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    with pytest.raises(KeyboardInterrupt):
        dp(torch.randn(6, 2))
    assert m.started == [0]


def test_system_exit_keeps_its_code():
    m = Interrupted(SystemExit(3), at=2)
    dp = dpfast.DataParallel(m, ["cpu"] * 4)
    with pytest.raises(SystemExit) as info:
        dp(torch.randn(8, 2))
    assert info.value.code == 3
    assert 3 not in m.started
