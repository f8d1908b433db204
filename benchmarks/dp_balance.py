"""Balanced work (``bench_dp.py --section balance``): cost= on a length-sorted packed LSTM batch.

A packed LSTM batch whose lengths come sorted (longest first, as ``pack_padded_sequence(enforce_sorted=True)``
wants them) on 2 and 4 CPU replicas: the count split against ``cost="ps"`` (the sequence lengths), as the
rehearsal's step time and as each split's slowest replica (its chunk timed alone: what a step waits for with one
device per replica), with each split's largest/mean cost from its ``plan()`` and largest/mean replica time. Then
the planning time of ``B = 10,000`` over 8 devices, with and without ``cost``.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from typing import Callable

import torch
from _timing import measure, ratio
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import dpfast

PACKED_B, PACKED_IN, PACKED_HIDDEN = 48, 64, 128


def sorted_lengths(batch: int, seed: int = 0) -> list[int]:
    """Skewed lengths (a few long sequences, many short ones), longest first."""
    g = torch.Generator().manual_seed(seed)
    return sorted((8 + 152 * torch.rand(batch, generator=g) ** 3).long().tolist(), reverse=True)


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(PACKED_IN, PACKED_HIDDEN)

    def forward(self, ps):
        return self.lstm(ps)


def packed_step(net: Callable, params: Sequence[torch.Tensor], ps) -> Callable[[], object]:
    def step():
        for p in params:
            p.grad = None
        out, (h, _) = net(ps)
        loss = out.data.pow(2).mean() + h.pow(2).mean()
        loss.backward()
        return loss

    return step


def run_balance(replicas: int, budget_s: float, rounds: int) -> dict:
    """Count split vs ``cost="ps"`` on ``replicas`` CPU replicas, two ways, all variants interleaved:

    * the rehearsal's own step (``DataParallel(["cpu"] * n)``): replicas on one CPU share its cores, and CPU
      backward runs on one thread for all of them, so this step costs about the sum of the replicas' work
      whatever the split;
    * the slowest replica: each chunk of the split timed alone with the plain module (its own forward + backward),
      the maximum per round. With one device per replica, that is what a step waits for.
    """
    lengths = sorted_lengths(PACKED_B)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, PACKED_IN, generator=g) for n in lengths]
    ps = pack_sequence(seqs)
    torch.manual_seed(0)
    plain = PackedLSTM().eval()
    params = list(plain.parameters())
    variants = {"plain": packed_step(plain, params, ps)}
    plans = {}
    for name, cost in (("count", None), ("cost", "ps")):
        torch.manual_seed(0)
        model = PackedLSTM().eval()
        dp = dpfast.DataParallel(model, ["cpu"] * replicas, out_dims=(0, 1), cost=cost)
        variants[name] = packed_step(dp, list(model.parameters()), ps)
        plans[name] = plan = dp.plan(ps)
        start = 0
        for j, size in enumerate(plan.sizes):
            if size:
                variants[f"{name}#{j}"] = packed_step(plain, params, pack_sequence(seqs[start : start + size]))
            start += size
    samples = measure(variants, torch.device("cpu"), budget_s, rounds)
    for name in ("count", "cost"):
        chunks = [samples[k] for k in samples if k.startswith(f"{name}#")]
        samples[f"{name} slowest"] = [max(c) for c in zip(*chunks)]
        samples[f"{name} time max/mean"] = [max(c) / statistics.mean(c) for c in zip(*chunks)]
    bal = plans["cost"].balance
    return {
        "replicas": replicas,
        "batch": PACKED_B,
        "lengths": lengths,
        "seconds": {k: statistics.median(v) for k, v in samples.items() if "max/mean" not in k},
        "count_sizes": plans["count"].sizes,
        "cost_sizes": plans["cost"].sizes,
        "count_costs": bal.count_costs,
        "cost_costs": bal.costs,
        "count_largest/mean": bal.count_imbalance,
        "cost_largest/mean": bal.imbalance,
        "count_time_max/mean": statistics.median(samples["count time max/mean"]),
        "cost_time_max/mean": statistics.median(samples["cost time max/mean"]),
        "cost/count": ratio(samples, "cost", "count"),
        "count/plain": ratio(samples, "count", "plain"),
        "cost/plain": ratio(samples, "cost", "plain"),
        "slowest cost/count": ratio(samples, "cost slowest", "count slowest"),
        "slowest count/plain": ratio(samples, "count slowest", "plain"),
        "slowest cost/plain": ratio(samples, "cost slowest", "plain"),
    }


def planning_time(rounds: int, batch: int = 10_000, devices: int = 8) -> dict:
    """Microseconds per ``plan()`` of ``B = batch`` over ``devices`` CPU replicas (nothing is copied), without and
    with ``cost``, and of the cost stage's two parts (reading the costs, the split), interleaved; medians over
    rounds. Measured with 1 intra-op thread and with the default: the cost stage is small tensor ops, which OpenMP
    wake-ups can stall on a busy machine."""
    from dpfast.plan import costs as _costs
    from dpfast.plan.costs import read_costs
    from dpfast.plan.splits import balanced_split

    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor(sorted((1 + 999 * torch.rand(batch, generator=g) ** 3).long().tolist(), reverse=True))
    f64 = torch.rand(batch, generator=g, dtype=torch.float64)
    x = torch.zeros(batch, 4)

    class Net(nn.Module):
        def forward(self, x, lengths):
            return x

    count = dpfast.DataParallel(Net(), ["cpu"] * devices)
    by_cost = dpfast.DataParallel(Net(), ["cpu"] * devices, cost="lengths")
    flops = lengths.double() ** 2 * 1.7  # full 53-bit significands over 20 binary orders: 94-bit exact sums
    prefix = read_costs(lengths, batch, "cost").prefix

    def python_ints(fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` with the exact arithmetic on Python ints (the reference, and what runs without the extension)."""

        def run() -> object:
            saved, _costs.C = _costs.C, None
            try:
                return fn()
            finally:
                _costs.C = saved

        return run

    forms: dict[str, Callable[[], object]] = {
        "plan, count split": functools.partial(count.plan, x, lengths),
        "plan, cost int64 tensor": functools.partial(by_cost.plan, x, lengths),
        "plan, cost float64 tensor": functools.partial(by_cost.plan, x, f64),
        "plan, cost float64 tensor, Python ints": python_ints(functools.partial(by_cost.plan, x, f64)),
        "plan, cost float64 lengths^2 * 1.7": functools.partial(by_cost.plan, x, flops),
        "plan, cost float64 lengths^2 * 1.7, Python ints": python_ints(functools.partial(by_cost.plan, x, flops)),
        "read costs, int64 tensor": functools.partial(read_costs, lengths, batch, "cost"),
        "read costs, list of ints": functools.partial(read_costs, lengths.tolist(), batch, "cost"),
        "read costs, float32 tensor": functools.partial(read_costs, lengths.float() * 0.37, batch, "cost"),
        "read costs, float64 tensor": functools.partial(read_costs, f64, batch, "cost"),
        "balanced_split": functools.partial(balanced_split, prefix, devices),
    }
    out = {"batch": batch, "devices": devices}
    default = torch.get_num_threads()
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        try:
            samples = measure(forms, torch.device("cpu"), 0.3 * rounds, rounds)
        finally:
            torch.set_num_threads(default)
        out[f"us_{threads}_threads"] = {k: 1e6 * statistics.median(v) for k, v in samples.items()}
    return out


def print_balance(rows: list, planning: dict | None) -> None:
    if rows:
        print(
            f"\npacked LSTM({PACKED_IN}, {PACKED_HIDDEN}) training step, B = {PACKED_B} sequences sorted by length "
            f"({rows[0]['lengths'][0]}..{rows[0]['lengths'][-1]}), 1 intra-op thread; ratios: medians of per-round "
            "ratios"
        )
        header = (
            f"{'replicas':>8} {'plain ms':>9} {'count ms':>9} {'cost ms':>8} {'cost/count':>10} "
            f"{'slowest: count ms':>17} {'cost ms':>8} {'cost/count':>10} {'cost/plain':>10} "
            f"{'cost max/mean: count':>20} {'cost':>5} {'time max/mean: count':>20} {'cost':>5}"
        )
        print(header)
        print("-" * len(header))
        for r in rows:
            t = r["seconds"]
            print(
                f"{r['replicas']:>8} {1e3 * t['plain']:>9.1f} {1e3 * t['count']:>9.1f} {1e3 * t['cost']:>8.1f} "
                f"{r['cost/count']:>10.3f} {1e3 * t['count slowest']:>17.1f} {1e3 * t['cost slowest']:>8.1f} "
                f"{r['slowest cost/count']:>10.3f} {r['slowest cost/plain']:>10.3f} "
                f"{r['count_largest/mean']:>20.2f} {r['cost_largest/mean']:>5.2f} "
                f"{r['count_time_max/mean']:>20.2f} {r['cost_time_max/mean']:>5.2f}"
            )
        print(
            "  count/cost ms: the CPU rehearsal's step (replicas share the CPU; CPU backward runs on one thread); "
            "slowest: the split's slowest chunk timed alone (what one device per replica waits for)"
        )
        for r in rows:
            print(
                f"  {r['replicas']} replicas: count split {r['count_sizes']} costs {r['count_costs']}; "
                f"cost split {r['cost_sizes']} costs {r['cost_costs']}"
            )
    if planning:
        cols = [k for k in planning if k.startswith("us_")]
        print(f"\nplanning time, B = {planning['batch']} over {planning['devices']} devices (nothing copied), us")
        print(f"  {'':<48}" + "".join(f"{k[3:].replace('_', ' '):>12}" for k in cols))
        for name in planning[cols[0]]:
            print(f"  {name:<48}" + "".join(f"{planning[k][name]:>12.1f}" for k in cols))


def plot_balance(rows: list, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    names = ("plain", "count", "cost", "count slowest", "cost slowest")
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        offset = (k - (len(names) - 1) / 2) * width
        label = name if "slowest" in name or name == "plain" else f"{name} split, rehearsal step"
        ax.bar([x + offset for x in xs], [1e3 * r["seconds"][name] for r in rows], width, label=label)
    ax.set_xticks(list(xs), [f"{r['replicas']} replicas" for r in rows])
    ax.set_ylabel("ms per training step (median)")
    ax.set_title("length-sorted packed LSTM, 1 thread: count split vs cost split", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
