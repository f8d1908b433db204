"""A long run: 1,000 training steps through DataParallel on the CPU rehearsal leave no growth in live Python objects,
threads or RSS, and the parameters and gradients match the plain module trained in lockstep."""

from __future__ import annotations

import copy
import gc
import os
import threading

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT, MLP

pytestmark = pytest.mark.usefixtures("one_thread")


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_soak_1000_steps_no_growth_and_gradients_match_plain_module():
    torch.manual_seed(0)
    module = MLP(4, 2, hidden=8).to(DT)
    plain = copy.deepcopy(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(7, 4, generator=g, dtype=DT), torch.randn(7, 2, generator=g, dtype=DT)) for _ in range(8)]

    class WithLoss(nn.Module):  # the loss inside the replica, reduced with "mean" weighted by chunk size
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, y):
            return ((self.m(x) - y) ** 2).mean()

    dp = dpfast.DataParallel(WithLoss(module), ["cpu"] * 3, out_dims="mean")
    threads = threading.active_count()
    objects = rss = 0
    for step in range(1000):
        x, y = data[step % len(data)]
        opt.zero_grad(set_to_none=True)
        dp(x, y).backward()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ((plain(x) - y) ** 2).mean().backward()
        ref_opt.step()
        if step == 99:  # after warm-up: caches, pool workers and optimizer state exist
            gc.collect()
            objects, rss = len(gc.get_objects()), _rss_bytes()
    gc.collect()
    grown_objects, grown_rss = len(gc.get_objects()) - objects, _rss_bytes() - rss
    print(f"soak: {grown_objects} more live objects, RSS {grown_rss / 2**20:+.2f} MiB over 900 steps")
    assert grown_objects <= 100
    assert grown_rss <= 8 * 2**20
    assert threading.active_count() <= threads + 2
    for p, q in zip(module.parameters(), plain.parameters()):
        # the chunked gradient sums in another order than the full batch: equal up to float64 rounding, after
        # 1000 steps of training in lockstep
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
