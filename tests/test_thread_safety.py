"""Thread safety: two DataParallel instances called from two threads at once, and one instance shared by both
threads, give the same outputs and gradients as the plain modules."""

from __future__ import annotations

import threading

import pytest
import torch

import dpfast

from dp_testing import DT, MLP

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_instances_from_two_threads_at_once():
    torch.manual_seed(0)
    cases = []
    for n, rows in [(2, 9), (3, 7)]:
        module = MLP(4, 2, hidden=8).to(DT)
        xs = [torch.randn(rows, 4, dtype=DT) for _ in range(4)]
        expected = []
        for x in xs:
            out = module(x)
            grads = torch.autograd.grad(out.square().sum(), list(module.parameters()))
            expected.append((out.detach(), grads))
        cases.append((dpfast.DataParallel(module, ["cpu"] * n), module, xs, expected))
    shared = dpfast.DataParallel(MLP(4, 2, hidden=8).to(DT), ["cpu"] * 2)  # and one instance shared by both threads
    shared_x = torch.randn(5, 4, dtype=DT)
    shared_expected = shared.module(shared_x).detach()

    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(case):
        dp, module, xs, expected = case
        try:
            barrier.wait()
            for step in range(30):
                x = xs[step % len(xs)]
                out = dp(x)
                grads = torch.autograd.grad(out.square().sum(), list(module.parameters()))
                want_out, want_grads = expected[step % len(xs)]
                torch.testing.assert_close(out, want_out)
                for a, b in zip(grads, want_grads):
                    torch.testing.assert_close(a, b)
                torch.testing.assert_close(shared(shared_x), shared_expected)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
