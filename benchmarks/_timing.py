"""Shared by the DataParallel benchmarks: variants timed interleaved in one run, compared as ratios.

Times are medians of the rounds; a ratio is the median of the per-round ratios (variants of one round share the
machine's state), which compares like with like on a noisy machine.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def run(fn, iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t) / iters

    return run


def measure(variants: dict, device: torch.device, budget_s: float, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each variant in every round; variants alternate within a round (order rotated)."""
    timer = _timer(device)
    for fn in variants.values():  # warm up: allocator, worker threads, replica caches
        for _ in range(3):
            fn()
    probe = max(timer(fn, 2) for fn in variants.values())
    iters = max(1, int(budget_s / rounds / len(variants) / max(probe, 1e-6)))
    names = list(variants)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            samples[name].append(timer(variants[name], iters))
    return samples


def ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of a's time over b's in the same round (robust to the machine's speed drifting)."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))
