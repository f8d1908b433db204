"""Where a rehearsal's forward time goes (``bench_dp.py --section inside``): the seed-000 RRN at ``B = 64`` on
``["cpu"] * 2``, each piece of ``dpfast.DataParallel.forward`` timed inside the running training step (the step
taking turns with the halves run by hand), then the same pieces called back to back, and planning alone after other
work of a few kinds.

Why it exists: on the 2-core machines these figures were first taken on, a piece of bookkeeping costs 5-10x inside
a step what it costs hot, and the cause is how long ago the interpreter last ran that code (planning after a sleep
costs about what it costs after a matmul), not the model's work. What cuts a rehearsal's overhead there is touching
less per call, not faster hot code; this section shows which pieces touch the most. It patches dpfast's private
functions with timers while it runs (and restores them): a diagnostic, not a ratio against a target.
"""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

import dpfast
from dpfast import data_parallel
from dpfast.run import replicas

CLOCK = time.perf_counter_ns
# (owner, attribute, label): the pieces of a call, in the order forward runs them
PIECES = [
    (data_parallel.DataParallel, "_current_settings", "settings check"),
    (data_parallel.DataParallel, "_plan_call", "planning"),
    (data_parallel, "_split", "split"),
    (replicas.ReplicaCache, "lease", "lease"),
    (data_parallel, "run_replicas", "running the replicas"),
    (replicas.Lease, "end", "the lease's end"),
    (data_parallel, "gather_outputs", "gather"),
]


@contextlib.contextmanager
def _timed(pieces: list, spent: dict) -> Iterator[None]:
    """Every piece wrapped with a timer adding its nanoseconds to ``spent[label]``; restored on exit."""
    # (None: inherited, as DataParallel's _current_settings: the timer is deleted again, not the method)
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in pieces]

    def timer(fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)  # (the model's forward keeps its signature: in_dims binds to it)
        def run(*args, **kwargs):
            start = CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + CLOCK() - start

        return run

    try:
        for owner, name, label in pieces:
            setattr(owner, name, timer(getattr(owner, name), label))
        yield
    finally:
        for owner, name, fn in saved:
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)


def _inside(bench, steps: int) -> dict:
    """Medians (µs) of each piece inside the dpfast step, of the model's forwards in both, and of both forwards."""
    x, target, h = _inputs(bench)
    plain, model = bench.build(torch.device("cpu")), bench.build(torch.device("cpu"))
    dp = dpfast.DataParallel(model, ["cpu"] * 2, in_dims=bench.IN_DIMS, out_dims=bench.OUT_DIMS)
    forwards = {
        "dpfast": (lambda: dp(x, x, h)[0], list(model.parameters())),
        "halves": (bench.halves_forward(plain, x, h), list(plain.parameters())),
    }
    samples: dict = {}
    spent: dict = {}
    with _timed(PIECES + [(bench.RRN, "forward", "the model's forwards")], spent):
        for i in range(steps + 50):
            order = list(forwards)
            random.Random(i).shuffle(order)
            for name in order:
                forward, params = forwards[name]
                for p in params:
                    p.grad = None
                spent.clear()
                start = CLOCK()
                out = forward()
                took = CLOCK() - start
                F.cross_entropy(out.reshape(-1, bench.CLASSES), target.reshape(-1)).backward()
                if i >= 50:
                    samples.setdefault(f"{name}: forward", []).append(took)
                    for label, ns in spent.items():
                        samples.setdefault(f"{name}: {label}", []).append(ns)
    return {k: statistics.median(v) / 1e3 for k, v in samples.items()}


def _hot(bench, calls: int) -> dict:
    """Medians (µs) of the same pieces called back to back, outside any step."""
    x, _, h = _inputs(bench)
    model = bench.build(torch.device("cpu"))
    dp = dpfast.DataParallel(model, ["cpu"] * 2, in_dims=bench.IN_DIMS, out_dims=bench.OUT_DIMS)
    with torch.no_grad():
        dp(x, x, h)
    settings, cpu = dp._current_settings(), torch.device("cpu")
    plan = dp._plan_call((x, x, h), {}, settings)

    def lease_and_end() -> None:
        dp._replicas.lease(model, cpu, [cpu, cpu]).end()

    pieces = {
        "settings check": dp._current_settings,
        "planning": lambda: dp._plan_call((x, x, h), {}, settings),
        "split": lambda: data_parallel._split(plan),
        "lease": lease_and_end,  # (with its end, for no outputs)
    }
    return {name: _median_us(fn, calls, lambda: None) for name, fn in pieces.items()}


def _after(bench, calls: int) -> dict:
    """Medians (µs) of planning right after each kind of other work."""
    x, _, h = _inputs(bench)
    dp = dpfast.DataParallel(bench.build(torch.device("cpu")), ["cpu"] * 2, in_dims=bench.IN_DIMS)
    settings = dp._current_settings()
    a, w = torch.randn(256, 1024), torch.randn(1024, 1024)

    def spin() -> None:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass

    before = {
        "nothing (back to back)": lambda: None,
        "a 2 ms Python spin loop": spin,
        "time.sleep(0.002)": lambda: time.sleep(0.002),
        "a (256, 1024) @ (1024, 1024) matmul": lambda: a @ w,
    }
    plan = functools.partial(dp._plan_call, (x, x, h), {}, settings)
    return {f"planning after {name}": _median_us(plan, calls, work) for name, work in before.items()}


def _median_us(fn: Callable[[], object], calls: int, before: Callable[[], object]) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        before()
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times) / 1e3


def _inputs(bench) -> tuple:
    return bench.batch_inputs(64, torch.device("cpu"))


def run_inside(bench, quick: bool) -> dict:
    """Every figure of the section (``bench``: the ``bench_dp`` module, for its RRN and config)."""
    steps, calls = (150, 300) if quick else (1500, 2000)
    return {"inside the step": _inside(bench, steps), "hot": _hot(bench, calls), "cold start": _after(bench, calls)}


def print_inside(result: dict) -> None:
    inside = result["inside the step"]
    print(f"\nwhere the rehearsal's forward goes: RRN B = 64, ['cpu'] * 2, {torch.get_num_threads()} threads, medians")
    print(f"  {'piece':40s} {'inside the step, µs':>20s} {'hot, µs':>10s}")
    hot, nan = result["hot"], float("nan")
    for _, _, label in PIECES:
        within = inside.get("dpfast: " + label, nan)
        if label == "running the replicas":  # beyond the model's own forwards
            label, within = "running the replicas (beyond the model)", within - inside["dpfast: the model's forwards"]
        print(f"  {label:40s} {within:20.1f} {hot.get(label, nan):10.1f}")
    print("  (hot: the lease with its end, for a call without outputs)")
    for key in ("dpfast: the model's forwards", "halves: the model's forwards", "dpfast: forward", "halves: forward"):
        print(f"  {key:40s} {inside.get(key, nan):20.1f}")
    for name, us in result["cold start"].items():
        print(f"  {name:60s} {us:8.1f} µs")
