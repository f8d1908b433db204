"""Replica-set rebuilds under a workload whose batch size varies: 500 training steps with B = 1..17 (in turn) on
``["cpu"] * 8``, a small MLP. Prints one JSON line: how many replica sets were built, and the cost per step of
dpfast and of the plain module on the same batches (interleaved step by step, so both see the same machine).

    python benchmarks/dp_replica_sets.py [--steps 500]

Run it against two trees in one sitting (``PYTHONPATH=<tree> python ...``, alternating) to compare them:
benchmarks/RESULTS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import dpfast


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    dp = dpfast.DataParallel(mlp, ["cpu"] * 8)
    batches = [torch.randn(1 + i % 17, 16) for i in range(args.steps)]
    times: dict[str, list[float]] = {"dpfast": [], "plain": []}
    for x in batches:
        for name, fn in (("dpfast", dp), ("plain", mlp)):
            t0 = time.perf_counter()
            fn(x).sum().backward()
            times[name].append(time.perf_counter() - t0)
    us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    print(json.dumps({"builds": dp._replicas.builds, "us_per_step": us, "ratio": us["dpfast"] / us["plain"]}))


if __name__ == "__main__":
    main()
