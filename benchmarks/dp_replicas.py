"""Fixed cost per extra replica (``bench_dp.py --section replicas``): a tiny MLP at B = 32 on 4 CPU replicas.

Variants, interleaved: ``plain`` (the module on the whole batch), ``in turn`` (the module on the 4 quarters one
after another: the floor of any 4-replica split on one interpreter) and ``dpfast`` (``DataParallel(mlp, ["cpu"] *
4)``), each as a forward alone and as a training step (forward, backward). The fixed cost per extra replica is
``(dpfast - in turn) / 4``; the target is 20 µs.
"""

from __future__ import annotations

import statistics

import torch
from _timing import measure, ratio
from torch import nn

import dpfast

REPLICAS, BATCH, FEATURES = 4, 32, 16


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 4))


def run_replicas(budget_s: float, rounds: int) -> list[dict]:
    x = torch.randn(BATCH, FEATURES)
    quarters = list(torch.split(x, BATCH // REPLICAS))
    rows = []
    for kind in ("forward", "train step"):
        mlp = _mlp()
        dp = dpfast.DataParallel(mlp, ["cpu"] * REPLICAS)

        def plain(mlp=mlp, kind=kind):
            out = mlp(x)
            if kind == "train step":
                out.sum().backward()

        def in_turn(mlp=mlp, kind=kind):
            outs = [mlp(q) for q in quarters]
            if kind == "train step":
                sum(o.sum() for o in outs).backward()

        def data_parallel(dp=dp, kind=kind):
            out = dp(x)
            if kind == "train step":
                out.sum().backward()

        if kind == "forward":
            plain, in_turn, data_parallel = (_no_grad(f) for f in (plain, in_turn, data_parallel))
        samples = measure(
            {"plain": plain, "in turn": in_turn, "dpfast": data_parallel}, torch.device("cpu"), budget_s, rounds
        )
        per_round = [(d - t) / REPLICAS for d, t in zip(samples["dpfast"], samples["in turn"])]
        rows.append(
            {
                "kind": kind,
                "seconds": {k: statistics.median(v) for k, v in samples.items()},
                "fixed_us_per_replica": 1e6 * statistics.median(per_round),
                "dpfast/in turn": ratio(samples, "dpfast", "in turn"),
                "dpfast/plain": ratio(samples, "dpfast", "plain"),
            }
        )
    return rows


def _no_grad(fn):
    def run():
        with torch.no_grad():
            fn()

    return run


def print_replicas(rows: list[dict]) -> None:
    print(f"\ntiny MLP ({FEATURES}-32-4), B = {BATCH} on {REPLICAS} CPU replicas: fixed cost per extra replica")
    print(f"{'':>11} {'plain µs':>10} {'in turn µs':>11} {'dpfast µs':>10} {'per replica µs':>15} {'dp/in turn':>11}")
    for r in rows:
        s = r["seconds"]
        print(
            f"{r['kind']:>11} {1e6 * s['plain']:>10.1f} {1e6 * s['in turn']:>11.1f} {1e6 * s['dpfast']:>10.1f} "
            f"{r['fixed_us_per_replica']:>15.1f} {r['dpfast/in turn']:>11.2f}"
        )
    worst = max(r["fixed_us_per_replica"] for r in rows)
    print(
        f"target fixed cost per extra replica <= 20 µs: worst {worst:.1f} µs -> {'met' if worst <= 20 else 'NOT met'}"
    )
