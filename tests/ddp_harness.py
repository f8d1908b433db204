"""Shared by the DistributedDataParallel tests: running scenarios on a group of gloo ranks (CPU processes on
loopback), a small RRN (seed 000's model) and its inputs and loss, and comparing outputs and gradients.

Process spawn is slow on this box, so each test module spawns **one** group per world size, which runs every
scenario in turn and writes one result per scenario and rank (``None`` or the failure text); the tests only read
those results. Every collective has a 30 s gloo timeout and the whole group a wall-clock limit, so a hang fails
instead of blocking, and the processes are killed in any case.

``DPFAST_TEST_SCENARIOS=name,name`` runs only those scenarios (one at a time, e.g. to see each fail on old code
without the others failing after it).

A test module defines ``_scenarios(world) -> {name: fn}`` at module level (the spawned ranks import it by name) and::

    RUNS = GroupRuns(_scenarios, worlds=(2, 3))
    test_group_ran_every_scenario = RUNS.group_test()
    test_scenario = RUNS.scenario_test()
"""

from __future__ import annotations

import functools
import gc
import json
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dp_testing import DT, MLP

GROUP_TIMEOUT_S = 150  # the whole spawned group; a healthy run takes a few seconds per scenario
COLLECTIVE_TIMEOUT_S = 30


def selected(scenarios: dict) -> dict:
    only = [n for n in os.environ.get("DPFAST_TEST_SCENARIOS", "").split(",") if n]
    return {k: v for k, v in scenarios.items() if not only or k in only}


def _worker(rank: int, world: int, port: int, outdir: str, scenarios: Callable) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results: dict = {}
    try:
        for name, fn in selected(scenarios(world)).items():
            try:
                fn()
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
            with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:  # written as we go: a hang still reports
                json.dump(results, f)
    finally:
        # every rank done before any tears down: torch 2.4's gloo hung rank 0 in destroy_process_group about one
        # group in five when a peer had already gone (all its scenarios done, its results written)
        gc.collect()  # wrappers kept alive by cycles (an exception's frames) release the group before it goes
        dist.barrier()
        dist.destroy_process_group()
    # Every scenario reported and the group is torn down: the process leaves without the interpreter's own teardown,
    # where about one 3-rank group in twenty aborted a rank ("terminate called without an active exception", from a
    # C++ thread still joinable at static destruction) after all of this had succeeded.
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(scenarios: Callable, world: int, timeout_s: float = GROUP_TIMEOUT_S) -> tuple[dict, list, list]:
    """Spawn ``world`` ranks running every scenario; returns (per-rank results, hung ranks, exit codes)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, outdir, scenarios), daemon=True) for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            t0 = time.monotonic()
            for p in procs:
                p.join(max(0.0, timeout_s - (time.monotonic() - t0)))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = {}
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[r] = json.load(f)
            else:
                results[r] = {}
        codes = [p.exitcode for p in procs]
    return results, hung, codes


class GroupRuns:
    """One group per world size, run once per test session, and the two tests that read it."""

    def __init__(self, scenarios: Callable, worlds: Sequence[int] = (2, 3)):
        self.scenarios = scenarios
        self.worlds = tuple(worlds)
        self.run = functools.cache(lambda world: run_group(scenarios, world))

    def group_test(self) -> Callable:
        @pytest.mark.parametrize("world", self.worlds)
        def test_group_ran_every_scenario(world):
            results, hung, codes = self.run(world)
            assert not hung, f"ranks {hung} hung; results so far: {results}"
            assert codes == [0] * world, f"exit codes {codes}"
            for r in range(world):
                assert set(results[r]) == set(selected(self.scenarios(world))), f"rank {r} ran {sorted(results[r])}"

        return test_group_ran_every_scenario

    def scenario_test(self) -> Callable:
        ids = [(w, name) for w in self.worlds for name in self.scenarios(w)]

        @pytest.mark.parametrize("world, name", ids, ids=[f"{w}ranks-{n}" for w, n in ids])
        def test_scenario(world, name):
            results, _, _ = self.run(world)
            missing = "did not run (see test_group_ran_every_scenario)"
            failures = {r: results[r].get(name, missing) for r in range(world)}
            failures = {r: f for r, f in failures.items() if f is not None}
            assert not failures, "\n".join(f"--- rank {r} ---\n{f}" for r, f in failures.items())

        return test_scenario


def expect_batch_error(call: Callable[[], object], contains: Sequence[str] = (), within_s: float = 20.0) -> str:
    """``call()`` raises DistributedBatchError naming every rank, promptly; returns its message."""
    from dpfast.distributed import DistributedBatchError

    t0 = time.monotonic()
    try:
        call()
    except DistributedBatchError as exc:
        msg = str(exc)
        for rank in range(dist.get_world_size()):
            assert f"rank {rank}" in msg, msg
        for c in contains:
            assert c in msg, msg
        assert time.monotonic() - t0 < within_s, f"raised after {time.monotonic() - t0:.1f} s: a collective timed out"
        return msg
    raise AssertionError("no DistributedBatchError")


# ---- models, inputs and comparisons ----------------------------------------------------------------------------


class RRN(nn.Module):
    """Seed 000's relational recurrent network, small: messages between N nodes, an LSTM(batch_first=True) whose
    state is (num_layers, B, H), i.e. batch on axis 1 (in_dims={'h': 1}, out_dims=(0, 0, 1))."""

    def __init__(self, d_in=3, hidden=5, message=4, out=2, layers=2):
        super().__init__()
        self.f = MLP(2 * hidden, message, hidden=8)
        self.g_mlp = MLP(d_in + message, 6, hidden=8)
        self.g = nn.LSTM(6, hidden, num_layers=layers, batch_first=True)
        self.o = MLP(hidden, out, hidden=8)
        self.message = message

    def forward(self, x, hidden, h):
        b, n, d = hidden.shape
        hi = hidden.repeat(1, n, 1)
        hj = hidden.unsqueeze(2).repeat(1, 1, n, 1).view(b, -1, d)
        messages = self.f(torch.cat((hi, hj), dim=2)).view(b, n, n, self.message).sum(dim=2)
        out, h = self.g(self.g_mlp(torch.cat((x, messages), dim=2)), h)
        hidden = out.clone()
        return self.o(hidden), hidden, h


def rrn_inputs(b, n=3, layers=2, hidden=5):
    g = torch.Generator().manual_seed(100 + b)
    x = torch.randn(b, n, 3, dtype=DT, generator=g)
    hid = torch.randn(b, n, hidden, dtype=DT, generator=g)
    h = (torch.randn(layers, b, hidden, dtype=DT, generator=g), torch.randn(layers, b, hidden, dtype=DT, generator=g))
    return x, hid, h


def rrn_loss(outputs):
    out, hidden, (hn, cn) = outputs
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape[1:], dtype=DT, generator=g)
    w_h = torch.randn(hn.shape[-1], dtype=DT, generator=g)
    return (out * w_out).sum() + (hidden**2).mean() + (hn * w_h).sum() + cn.pow(2).sum()


def xy(b):
    g = torch.Generator().manual_seed(200 + b)
    return torch.randn(b, 4, dtype=DT, generator=g), torch.randn(b, 2, dtype=DT, generator=g)


def losses_loss(outputs):
    mse, sse, pred = outputs
    return mse + 0.1 * sse + pred.pow(2).mean()


def grads(module):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in module.named_parameters()}


def assert_tree_close(actual, expected, what):
    a_leaves, a_spec = torch.utils._pytree.tree_flatten(actual)
    e_leaves, e_spec = torch.utils._pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, msg=lambda m, i=i: f"{what} leaf {i}: {m}")
        else:
            assert a == pytest.approx(e), f"{what} leaf {i}: {a} != {e}"
