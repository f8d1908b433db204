"""What walking a call's trees costs, for the two shapes the walks must be fast on (a list of 2,000 small tensors; a
Hugging Face-style call with a handful of ``(B, T)`` tensors by keyword): binding and walking the arguments, putting
a replica's leaves back, walking the replicas' outputs, ``plan()``, the call itself, and, as yardsticks measured in
the same rounds, ``torch.utils._pytree.tree_flatten`` of the arguments and the same split-and-concatenate written by
hand with it (no checks, no plan).

    python benchmarks/dp_trees.py [--rounds 15] [--json OUT]

Compare two versions of dpfast by running it once per tree (``PYTHONPATH=<tree> python benchmarks/dp_trees.py``),
alternating the trees in one sitting, and comparing each row's ratio to the pytree yardsticks: absolute times on a
shared machine drift between runs, the ratios much less. Rows are medians over rounds, in µs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.utils._pytree as pytree
from torch import nn

import dpfast
from dpfast.move.gather import gather_outputs

try:
    from dpfast.trees.binding import Binding, BoundArguments
except ImportError:  # the recursive walks before the iterative one (to measure both)
    from dpfast.trees.binding import ArgumentSpecs as Binding
    from dpfast.trees.binding import ArgumentTree as BoundArguments


class ListNet(nn.Module):
    def forward(self, xs):
        return xs


class HFNet(nn.Module):
    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None):
        return {"logits": input_ids, "mask": attention_mask, "labels": labels}


def by_hand(module: nn.Module, n: int, args: tuple, kwargs: dict):
    """torch.utils._pytree: flatten, split every tensor along 0, one call per chunk, concatenate each leaf."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    chunks = [t.tensor_split(n) for t in leaves]
    outs = []
    for j in range(n):
        a, k = pytree.tree_unflatten([c[j] for c in chunks], spec)
        outs.append(module(*a, **k))
    flat = [pytree.tree_flatten(o)[0] for o in outs]
    cat = [torch.cat(col) for col in zip(*flat)]
    return pytree.tree_unflatten(cat, pytree.tree_flatten(outs[0])[1])


def cases() -> dict:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, generator=g) for _ in range(2000)]
    b, t = 8, 128
    hf = {
        "input_ids": torch.randint(0, 1000, (b, t), generator=g),
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "token_type_ids": torch.zeros(b, t, dtype=torch.long),
        "position_ids": torch.arange(t).expand(b, t).contiguous(),
        "labels": torch.randint(0, 1000, (b, t), generator=g),
    }
    return {"list of 2,000 tensors": (ListNet(), (xs,), {}, 2000), "HF-style kwargs (5 tensors)": (HFNet(), (), hf, 5)}


def _variants(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    dp = dpfast.DataParallel(module, ["cpu"] * 2)
    binding = Binding(module.forward, None, 0)
    tree = BoundArguments(binding, args, kwargs)
    leaves = [leaf.value for leaf in tree.leaves]
    outputs = [module(*args, **kwargs)] * 2
    cpu = torch.device("cpu")
    return {
        "walk the arguments": lambda: BoundArguments(binding, args, kwargs),
        "put a replica's leaves back": lambda: tree.rebuild(leaves, own_caches=True),
        "gather 2 replicas' outputs": lambda: gather_outputs(outputs, None, 0, cpu, [1, 1]),
        "plan()": lambda: dp.plan(*args, **kwargs),
        "call": lambda: dp(*args, **kwargs),
        "pytree flatten": lambda: pytree.tree_flatten((args, kwargs)),
        "by hand (pytree)": lambda: by_hand(module, 2, args, kwargs),
    }


def _measure(variants: dict, rounds: int, iters: int) -> dict[str, list[float]]:
    """µs per call of each variant, per round (variants interleaved within a round)."""
    for fn in variants.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[k].append((time.perf_counter() - t0) / iters * 1e6)
    return samples


def _ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name, (module, args, kwargs, n_leaves) in cases().items():
        samples = _measure(_variants(module, args, kwargs), a.rounds, 20 if n_leaves > 100 else 400)
        row = {k: statistics.median(v) for k, v in samples.items()}
        for k in ("walk the arguments", "put a replica's leaves back", "gather 2 replicas' outputs", "plan()"):
            row[f"{k} / pytree flatten"] = _ratio(samples, k, "pytree flatten")
        row["call / by hand"] = _ratio(samples, "call", "by hand (pytree)")
        row["plan() per leaf"] = row["plan()"] / n_leaves
        results[name] = row
        print(name)
        for k, v in row.items():
            print(f"  {k:45s} {v:10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dpfast": dpfast.__file__, "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
