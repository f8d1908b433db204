"""DistributedDataParallel (``bench_dp.py --section ddp``): a dpfast step against torch's DDP step, and per-rank
loading's balance.

**Step time.** Two CPU processes (gloo on loopback, one intra-op thread each), a 64-128-10 MLP at ``B = 64`` (32
rows per rank); one training step = zero_grad, forward, cross-entropy, backward. Variants, timed inside the
ranks taking turns step by step, in an order drawn anew every step, each step timed; a variant's figure is the
median of all its steps, and a ratio is of two such medians:

* ``torch``: torch's DDP on this rank's 32 rows (and ``torch (again)``, the same step timed as another variant:
  its ratio to ``torch`` is the measurement's noise floor);
* ``dpfast``: ``dpfast.DistributedDataParallel`` given the global batch (it keeps its 32 rows);
* ``dpfast unchecked``: the same with ``check_batch=False`` (what the checks cost);
* ``dpfast (Python hook)``: ``dpfast`` with the check's Python comm hook (what CUDA buckets, a user's own comm hook
  and the pure-Python fallback get) instead of the C++ one;
* ``dpfast per-rank``: ``inputs="per_rank"``, given this rank's 32 rows;
* ``torch+gather``: torch's DDP, then ``torch.distributed.nn.functional.all_gather`` of the outputs and the loss on
  the full batch;
* ``dpfast gather`` / ``dpfast per-rank gather``: ``gather_outputs=True``, the loss on the gathered outputs.

Target: ``dpfast`` <= 1.10x ``torch``, and the gather variants <= 1.10x ``torch+gather``. On this 2-core machine
two ranks' step is mostly their loopback round trip, so every step variant is also timed on **one rank** (a group
of one: the same reducer, hooks and exchanges, no peer), where what the wrapper costs is not hidden in a peer's
latency. The collectives each step issues are counted too (as ``tests/test_distributed_checks.py`` does, on
separate wrappers whose DDP reducer runs through torch's Python default comm hook, so that the counter sees it).

**Many tensors.** One forward (under ``no_grad``) of a list of ``TINY`` = 10,000 tensors ``(8, 2)`` through a module
that scales each by one weight: ``dpfast many`` is given the global list (each rank keeps its 4 rows of every
tensor), ``torch many`` (torch's DDP) this rank's rows, sliced beforehand. Target: ``dpfast many`` <= 1.0x. Beside
them, each with its own counterpart: ``torch many, cut in the call`` (torch's DDP given the rows a torch user who
holds the global list slices in the step, ``x[start:stop]`` each) against ``dpfast many``, and ``dpfast many
per-rank`` (``inputs="per_rank"``, given this rank's rows, sliced beforehand) against ``torch many``; and both of
dpfast's with ``check_batch=False`` (``unchecked``: no per-call agreement, the round trip a no_grad forward
otherwise waits for) against the same counterparts.

**Balance.** Per-rank loading's samplers: :mod:`dp_rank_balance`.
"""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
import torch.nn.functional as F
from dp_rank_balance import run_balance
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import dpfast
from dpfast.distributed import shard_range
from dpfast.distributed.bucket_check import NativeBucketCheck

WORLD, BATCH = 2, 64
RATIOS = [
    ("torch (again)", "torch"),  # the noise floor: the same step, timed as another variant
    ("dpfast", "torch"),
    ("dpfast unchecked", "torch"),
    ("dpfast (Python hook)", "torch"),
    ("dpfast per-rank", "torch"),
    ("dpfast gather", "torch+gather"),
    ("dpfast per-rank gather", "torch+gather"),
]
TINY = 10_000  # tensors in the many-tensors row (2,000 with --quick)

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object")
_COLLECTIVES += ("all_to_all_single", "broadcast", "_broadcast_coalesced", "scatter")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _python_hook_wrapper(module: nn.Module) -> dpfast.DistributedDataParallel:
    """A wrapper whose check runs through the Python comm hook, as on CUDA buckets (``native_hook_available``)."""
    saved = dpfast.distributed.module.native_hook_available
    dpfast.distributed.module.native_hook_available = lambda module, group: False
    try:
        return dpfast.DistributedDataParallel(module)
    finally:
        dpfast.distributed.module.native_hook_available = saved


def _steps(count: bool) -> dict:
    """The step of every variant on this rank (``count``: torch's reducer through the Python default hook)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    mine = shard_range(BATCH, rank, world)
    xs, ys = x[mine.start : mine.stop], y[mine.start : mine.stop]
    torch_ddp, torch_gather = nn.parallel.DistributedDataParallel(_mlp()), nn.parallel.DistributedDataParallel(_mlp())
    ours = {
        "dpfast": dpfast.DistributedDataParallel(_mlp()),
        "dpfast unchecked": dpfast.DistributedDataParallel(_mlp(), check_batch=False),
        "dpfast (Python hook)": _python_hook_wrapper(_mlp()),
        "dpfast per-rank": dpfast.DistributedDataParallel(_mlp(), inputs="per_rank"),
        "dpfast gather": dpfast.DistributedDataParallel(_mlp(), gather_outputs=True),
        "dpfast per-rank gather": dpfast.DistributedDataParallel(_mlp(), inputs="per_rank", gather_outputs=True),
    }
    if count:
        for m in [torch_ddp, torch_gather, ours["dpfast gather"], ours["dpfast per-rank gather"]]:
            m.register_comm_hook(None, default_hooks.allreduce_hook)

    def step(model, inputs, target, gather_by_hand=False):
        def run():
            model.zero_grad(set_to_none=True)
            out = model(inputs)
            if gather_by_hand:
                out = torch.cat(dist_nn.all_gather(out))
            F.cross_entropy(out, target).backward()

        run.model = model  # type: ignore[attr-defined]
        return run

    return {
        "torch": step(torch_ddp, xs, ys),
        "torch (again)": step(torch_ddp, xs, ys),
        "dpfast": step(ours["dpfast"], x, ys),
        "dpfast unchecked": step(ours["dpfast unchecked"], x, ys),
        "dpfast (Python hook)": step(ours["dpfast (Python hook)"], x, ys),
        "dpfast per-rank": step(ours["dpfast per-rank"], xs, ys),
        "torch+gather": step(torch_gather, xs, y, gather_by_hand=True),
        "dpfast gather": step(ours["dpfast gather"], x, y),
        "dpfast per-rank gather": step(ours["dpfast per-rank gather"], xs, y),
    }


class _ScaleEach(nn.Module):
    """Every tensor of a list times one weight (DDP needs a parameter): the same per-tensor work for both."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, xs: list) -> list:
        return [x * self.w for x in xs]


def _many_tensors(n: int) -> dict:
    """A forward of ``n`` tiny tensors through each DDP, under no_grad (no reducer round per call)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 2, generator=g) for _ in range(n)]
    mine = shard_range(8, rank, world)
    shard = [x[mine.start : mine.stop] for x in xs]
    torch_ddp, ours = nn.parallel.DistributedDataParallel(_ScaleEach()), dpfast.DistributedDataParallel(_ScaleEach())
    per_rank = dpfast.DistributedDataParallel(_ScaleEach(), inputs="per_rank")
    unchecked = dpfast.DistributedDataParallel(_ScaleEach(), check_batch=False)
    per_rank_unchecked = dpfast.DistributedDataParallel(_ScaleEach(), inputs="per_rank", check_batch=False)
    with torch.no_grad():  # the same result, or the row means nothing
        for model, given in ((ours, xs), (per_rank, shard), (unchecked, xs), (per_rank_unchecked, shard)):
            assert all(torch.equal(a, b) for a, b in zip(model(given), torch_ddp(shard)))

    def call(model, inputs):
        def run():
            with torch.no_grad():
                model(inputs)

        return run

    def cut_in_call():
        with torch.no_grad():
            torch_ddp([x[mine.start : mine.stop] for x in xs])

    return {
        "torch many": call(torch_ddp, shard),
        "dpfast many": call(ours, xs),
        "torch many, cut in the call": cut_in_call,
        "dpfast many per-rank": call(per_rank, shard),
        "dpfast many unchecked": call(unchecked, xs),
        "dpfast many per-rank unchecked": call(per_rank_unchecked, shard),
    }


MANY_RATIOS = [
    ("dpfast many", "torch many"),
    ("dpfast many", "torch many, cut in the call"),
    ("dpfast many per-rank", "torch many"),
    ("dpfast many unchecked", "torch many, cut in the call"),
    ("dpfast many per-rank unchecked", "torch many"),
]


def _timed(variants: dict, budget_s: float, rounds: int) -> dict:
    """Seconds of every step of every variant (``rounds`` times as many steps as fit in ``budget_s`` / ``rounds``),
    the same steps on every rank (rank 0 decides how many).

    The variants take turns step by step, in an order drawn anew for every step (the same on every rank: their
    collectives must match), each step timed alone; a variant's figure is the median of all its steps
    (:func:`_ratio`). A loopback round trip's latency drifts over seconds, and variants timed in blocks of their
    own steps caught different stretches of it; in a fixed order each variant follows the same one every time, and
    a step right after one of the same model runs faster; the medians of a round's few dozen steps jump between the
    modes of the round trip's latency; and a barrier before each block made the ranks' first steps after it wait
    on each other unlike the rest (benchmarks/RESULTS.md)."""
    for fn in variants.values():
        for _ in range(5):
            fn()
    probe = []
    for fn in variants.values():
        t = time.perf_counter()
        for _ in range(3):
            fn()
        probe.append((time.perf_counter() - t) / 3)
    iters = [max(3, int(budget_s / rounds / len(variants) / max(probe)))]
    dist.broadcast_object_list(iters, 0)
    names, clock = list(variants), time.perf_counter_ns
    samples: dict = {k: [] for k in names}
    dist.barrier()
    for i in range(rounds * iters[0]):
        order = list(names)
        random.Random(i).shuffle(order)
        for name in order:
            t = clock()
            variants[name]()
            samples[name].append((clock() - t) / 1e9)
    return samples


def _ratio(samples: dict, a: str, b: str) -> float:
    """Variant ``a``'s median step over ``b``'s (every step, timed in turns: :func:`_timed`)."""
    return statistics.median(samples[a]) / statistics.median(samples[b])


def _counting(calls: list, name: str, fn):
    def wrapper(*args, **kwargs):
        calls.append(f"{name}{'' if kwargs.get('async_op') else ' (blocking)'}")
        return fn(*args, **kwargs)

    return wrapper


def _native_collectives(step) -> int:
    """The all-reduces a wrapper's C++ check hook issued (the Python counter does not see them)."""
    check = getattr(getattr(step, "model", None), "_bucket_check", None)
    return check.collectives if isinstance(check, NativeBucketCheck) else 0


def _counted(variants: dict, steps: int = 5) -> dict:
    """Collectives per step of every variant, as "name" or "name (blocking)" -> count."""
    out = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        calls: list = []
        saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
        for n, f in saved.items():
            setattr(dist, n, _counting(calls, n, f))
        before = _native_collectives(fn)
        try:
            for _ in range(steps):
                fn()
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
        calls += ["all_reduce"] * (_native_collectives(fn) - before)  # the C++ check hook's (async)
        out[name] = {k: v / steps for k, v in collections.Counter(calls).items()}
    return out


ONE_RANK = ("torch", "torch (again)", "dpfast", "dpfast unchecked", "dpfast (Python hook)", "dpfast per-rank")
ONE_RANK += ("torch+gather", "dpfast gather", "dpfast per-rank gather")  # every variant of RATIOS


def _worker(rank: int, world: int, port: int, outdir: str, budget_s: float, rounds: int, tiny: int) -> None:
    """Rank ``rank`` of ``world``: every row (a group of one: the step variants of ``ONE_RANK`` only, no peer)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        if world == 1:
            steps = _steps(count=False)
            raw: dict = {"samples": _timed({k: steps[k] for k in ONE_RANK}, budget_s, rounds)}
        else:
            raw = {"samples": _timed(_steps(count=False), budget_s, rounds)}
            raw["counts"] = _counted(_steps(count=True))
            raw["many"] = _timed(_many_tensors(tiny), budget_s, rounds)
        if rank == 0:
            with open(os.path.join(outdir, "result.json"), "w") as f:
                json.dump(raw, f)
    finally:
        dist.destroy_process_group()


def _spawned(world: int, budget_s: float, rounds: int, tiny: int) -> dict:
    """Rank 0's results of :func:`_worker` on ``world`` spawned ranks."""
    return spawn_ranks(_worker, world, budget_s, rounds, tiny)


def spawn_ranks(target, world: int, budget_s: float, *args) -> dict:
    """What rank 0 of ``world`` spawned ranks ``target(rank, world, port, outdir, budget_s, *args)`` wrote to
    ``outdir/result.json`` (the ranks are killed if they overrun)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        common = (world, _free_port(), outdir, budget_s, *args)
        procs = [ctx.Process(target=target, args=(r, *common)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30 * budget_s + 120)
            if p.is_alive():
                p.kill()
        with open(os.path.join(outdir, "result.json")) as f:
            return json.load(f)


def run_one_rank(budget_s: float, rounds: int) -> dict:
    """Seconds per step of the step variants on one rank (spawns it), and the ratios of RATIOS."""
    samples = _spawned(1, budget_s, rounds, 0)["samples"]
    return {
        "seconds": {k: statistics.median(v) for k, v in samples.items()},
        "ratios": {f"{a}/{b}": _ratio(samples, a, b) for a, b in RATIOS},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_steps(budget_s: float, rounds: int, tiny: int = TINY) -> dict:
    """The step-time rows and the many-tensors row (spawns the two ranks)."""
    raw = _spawned(WORLD, budget_s, rounds, tiny)
    samples = raw["samples"]
    times = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {f"{a}/{b}": _ratio(samples, a, b) for a, b in RATIOS}
    many = raw["many"]
    return {
        "seconds": times,
        "ratios": ratios,
        "collectives per step": raw["counts"],
        "rounds": rounds,
        "many tensors": {
            "tensors": tiny,
            "seconds": {k: statistics.median(v) for k, v in many.items()},
            **{f"{a}/{b}": _ratio(many, a, b) for a, b in MANY_RATIOS},
        },
    }


def run_ddp(quick: bool, budget_s: float, rounds: int) -> dict:
    rounds = rounds if quick else 2 * rounds
    steps = run_steps(budget_s, rounds, TINY // 5 if quick else TINY)
    steps["one rank"] = run_one_rank(budget_s, rounds)
    return {"steps": steps, "balance": run_balance(n=4096 if quick else 16384)}


def print_ddp(result: dict) -> None:
    s = result["steps"]
    print(
        f"\nDistributedDataParallel training step: {WORLD} gloo ranks on this machine, 1 intra-op thread each, a "
        f"64-128-10 MLP at B = {BATCH}; the variants' steps in turns, in a fresh order every step, medians"
    )
    print(f"{'variant':<24} {'ms / step':>10}  collectives per step")
    for name, sec in s["seconds"].items():
        counts = ", ".join(f"{v:g} {k}" for k, v in sorted(s["collectives per step"][name].items()))
        print(f"{name:<24} {1e3 * sec:>10.3f}  {counts}")
    for key, value in s["ratios"].items():
        verdict = (
            "(noise floor)"
            if key.startswith("torch (again)")
            else f"target <= 1.10: {'met' if value <= 1.10 else 'NOT met'}"
        )
        print(f"{key:<40} {value:>6.3f}   {verdict}")
    one = s["one rank"]
    print("\nThe same step on one rank (a group of one: no peer latency), ms / step and ratio to its counterpart")
    for name, sec in one["seconds"].items():
        key = next((k for k in one["ratios"] if k.startswith(f"{name}/")), None)
        ratio = "" if key is None else f"{one['ratios'][key]:.3f} ({key})"
        print(f"{name:<24} {1e3 * sec:>10.3f}  {ratio}")
    m = s["many tensors"]
    sec = m["seconds"]
    print(f"\n{m['tensors']} tensors (8, 2), one forward under no_grad, ms (µs a tensor)")
    for name, t in sec.items():
        print(f"{name:<30} {1e3 * t:>8.1f}  ({1e6 * t / m['tensors']:.1f})")
    for a, b in MANY_RATIOS:
        r = m[f"{a}/{b}"]
        print(f"{a + ' / ' + b:<58} {r:>6.3f}   target <= 1.0: {'met' if r <= 1.0 else 'NOT met'}")
    b = result["balance"]
    print(
        f"\nPer-rank loading, {b['world']} ranks x {b['per_rank_batch']} samples per step, {b['samples']} "
        "long-tailed costs: the slowest rank's cost / the mean rank's"
    )
    print(f"{'dataset order':<16} {'sampler':<22} {'mean':>7} {'p95':>7}  epoch (sum of slowest)")
    for order, row in b["rows"].items():
        for sampler in ("DistributedSampler", "BalancedBatchSampler"):
            r = row[sampler]
            print(
                f"{order:<16} {sampler:<22} {r['slowest/mean (mean over steps)']:>7.3f} {r['slowest/mean (p95)']:>7.3f}"
                f"  {r['epoch cost (sum of slowest)']:>10}"
            )
        print(f"{'':<16} {'epoch: balanced / distributed':<39} {row['epoch cost ratio']:.3f}")


def plot_ddp(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    ratios = {
        **result["steps"]["ratios"],
        **{f"{a}/{b}": result["steps"]["many tensors"][f"{a}/{b}"] for a, b in MANY_RATIOS},
    }
    a1.barh(list(ratios), list(ratios.values()))
    a1.axvline(1.10, color="gray", ls="--", lw=1, label="target 1.10")
    a1.set_xlabel("time per step, ratio (lower is better)")
    a1.set_title(f"DDP step, {WORLD} gloo ranks")
    a1.legend()
    rows = result["balance"]["rows"]
    labels, values = [], []
    for order, row in rows.items():
        for sampler in ("DistributedSampler", "BalancedBatchSampler"):
            labels.append(f"{order}\n{sampler}")
            values.append(row[sampler]["slowest/mean (mean over steps)"])
    a2.barh(labels, values)
    a2.axvline(1.0, color="gray", ls=":", lw=1)
    a2.set_xlabel("slowest rank / mean rank, per step (1 is perfect)")
    a2.set_title("per-rank loading, long-tailed costs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
