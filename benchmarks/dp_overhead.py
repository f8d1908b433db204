"""Per-leaf and per-call overhead (``bench_dp.py --section overhead``): what dpfast costs beyond the data it moves.

Rows, each against its counterpart in the same run (interleaved rounds, ratios per round, medians):

* ``leaves``: one call with a list of ``N`` small tensors ``(8, 2)`` on ``["cpu"] * 2`` through an identity module,
  against the same split-and-concatenate written by hand (``torch.utils._pytree`` flatten, ``Tensor.split`` per
  leaf, the module on each half, ``torch.cat`` per leaf, unflatten). Target: dpfast <= 0.7x by hand.
* ``plan``: ``plan()`` of that call, per leaf. Target: <= 2 µs a leaf.
* ``int list``: a call whose second argument is a list of ``N`` ints (passed by reference to every replica) beside a
  tensor to split, ``plan()`` of it, and torch's ``scatter`` of the list alone (its pure-Python walk; torch's scatter
  of CPU tensors needs CUDA). Target: linear in ``N``, no slower than torch's.
"""

from __future__ import annotations

import statistics

import torch
import torch.utils._pytree as pytree
from _timing import measure, ratio
from torch import nn
from torch.nn.parallel.scatter_gather import scatter as torch_scatter

import dpfast

REPLICAS = 2


class Identity(nn.Module):
    def forward(self, *args):
        return args[0] if len(args) == 1 else args


def _by_hand(module: nn.Module, value, n: int):
    """The call written by hand: split every leaf in ``n`` along dim 0, run the module per part, concatenate."""
    leaves, spec = pytree.tree_flatten(value)
    chunks = [t.split(-(-t.shape[0] // n)) for t in leaves]
    outs = [module(pytree.tree_unflatten([c[j] for c in chunks], spec)) for j in range(n)]
    flat = [pytree.tree_flatten(o)[0] for o in outs]
    return pytree.tree_unflatten([torch.cat(col) for col in zip(*flat)], spec)


def run_leaves(n_leaves: int, budget_s: float, rounds: int) -> dict:
    torch.manual_seed(0)
    value = [torch.randn(8, 2) for _ in range(n_leaves)]
    module = Identity()
    dp = dpfast.DataParallel(module, ["cpu"] * REPLICAS)
    for got, want in zip(dp(value), _by_hand(module, value, REPLICAS)):  # the same result, or the row means nothing
        assert torch.equal(got, want)
    with torch.no_grad():
        samples = measure(
            {
                "dpfast": lambda: dp(value),
                "by hand": lambda: _by_hand(module, value, REPLICAS),
                "plan()": lambda: dp.plan(value),
            },
            torch.device("cpu"),
            budget_s,
            rounds,
        )
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "leaves": n_leaves,
        "seconds": med,
        "us_per_leaf": {k: 1e6 * v / n_leaves for k, v in med.items()},
        "dpfast/by hand": ratio(samples, "dpfast", "by hand"),
    }


def run_int_list(n_ints: int, budget_s: float, rounds: int) -> dict:
    ids = list(range(n_ints))
    x = torch.randn(4 * REPLICAS, 3)
    module = Identity()
    dp = dpfast.DataParallel(module, ["cpu"] * REPLICAS)
    with torch.no_grad():
        samples = measure(
            {
                "dpfast call": lambda: dp(x, ids),
                "dpfast plan()": lambda: dp.plan(x, ids),
                "torch scatter": lambda: torch_scatter((ids,), [0, 1]),
            },
            torch.device("cpu"),
            budget_s,
            rounds,
        )
    return {
        "ints": n_ints,
        "seconds": {k: statistics.median(v) for k, v in samples.items()},
        "call/torch scatter": ratio(samples, "dpfast call", "torch scatter"),
        "plan/torch scatter": ratio(samples, "dpfast plan()", "torch scatter"),
    }


def run_overhead(quick: bool, budget_s: float, rounds: int) -> dict:
    leaves = [run_leaves(n, budget_s, rounds) for n in ((200, 2000) if quick else (200, 2000, 20000))]
    ints = [run_int_list(n, budget_s, max(3, rounds // 3)) for n in ((1000, 10000) if quick else (10000, 100000))]
    return {"leaves": leaves, "int_list": ints}


def print_overhead(result: dict) -> None:
    print(f"\nper-leaf overhead: a list of N tensors (8, 2) on {REPLICAS} CPU replicas, identity module")
    print(f"{'N':>7} {'dpfast µs/leaf':>15} {'by hand µs/leaf':>16} {'plan() µs/leaf':>15} {'dpfast/by hand':>15}")
    for r in result["leaves"]:
        u = r["us_per_leaf"]
        print(
            f"{r['leaves']:>7} {u['dpfast']:>15.2f} {u['by hand']:>16.2f} {u['plan()']:>15.2f} "
            f"{r['dpfast/by hand']:>15.2f}"
        )
    worst_call = max(r["dpfast/by hand"] for r in result["leaves"])
    worst_plan = max(r["us_per_leaf"]["plan()"] for r in result["leaves"])
    print(
        f"targets: call <= 0.7x by hand: worst {worst_call:.2f} -> {'met' if worst_call <= 0.7 else 'NOT met'}; "
        f"plan() <= 2 µs a leaf: worst {worst_plan:.2f} -> {'met' if worst_plan <= 2 else 'NOT met'}"
    )
    print("\na list of N ints beside a tensor to split (the ints reach every replica by reference)")
    print(f"{'N':>7} {'call s':>9} {'plan() s':>9} {'torch scatter s':>16} {'call/torch':>11} {'plan/torch':>11}")
    for r in result["int_list"]:
        s = r["seconds"]
        print(
            f"{r['ints']:>7} {s['dpfast call']:>9.4f} {s['dpfast plan()']:>9.4f} {s['torch scatter']:>16.4f} "
            f"{r['call/torch scatter']:>11.2f} {r['plan/torch scatter']:>11.2f}"
        )
    rows = result["int_list"]
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        growth = (b["seconds"]["dpfast call"] / a["seconds"]["dpfast call"]) / (b["ints"] / a["ints"])
        print(f"call time per int, largest N over smallest: {growth:.2f} (1.0 is linear)")
