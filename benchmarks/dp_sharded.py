"""``dpfast.distributed.fully_shard`` (``bench_dp.py --section fsdp``): a dpfast step against torch's FSDP2 step.

The rows of ``--section ddp`` (:mod:`dp_distributed`), on FSDP2: two CPU processes (gloo on loopback, one intra-op
thread each), a 64-128-10 MLP at ``B = 64`` (32 rows per rank), one training step = zero_grad, forward,
cross-entropy, backward, the variants timed in turns step by step in an order drawn anew every step (medians):

* ``torch``: torch's ``fully_shard`` on this rank's 32 rows (``torch (again)``: the same, the noise floor);
* ``dpfast``: ``dpfast.distributed.fully_shard`` given the global batch (it keeps its 32 rows); its check is one
  small all-gather per forward; ``dpfast unchecked``: ``check_batch=False`` (what the check costs);
* ``dpfast per-rank``: ``inputs="per_rank"``, given this rank's 32 rows;
* ``torch+gather``: torch's FSDP2, then ``torch.distributed.nn.functional.all_gather`` of the outputs and the loss on
  the full batch; ``dpfast gather``: ``gather_outputs=True``, the loss on the gathered outputs.

Target: ``dpfast`` <= 1.10x ``torch`` and ``dpfast gather`` <= 1.10x ``torch+gather``. As for DDP, every variant is
also timed on one rank (a group of one, where the check runs no collective), where the wrapper's cost is not
hidden in a peer's latency.
"""

from __future__ import annotations

import json
import os
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from dp_distributed import BATCH, WORLD, _mlp, _ratio, _timed, spawn_ranks

import dpfast.distributed
from dpfast.distributed import shard_range

RATIOS = [
    ("torch (again)", "torch"),
    ("dpfast", "torch"),
    ("dpfast unchecked", "torch"),
    ("dpfast per-rank", "torch"),
    ("dpfast gather", "torch+gather"),
]


def _steps() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    mine = shard_range(BATCH, rank, world)
    xs, ys = x[mine.start : mine.stop], y[mine.start : mine.stop]
    torch_fsdp, torch_gather = fully_shard(_mlp(), mesh=mesh), fully_shard(_mlp(), mesh=mesh)
    ours = {
        "dpfast": dpfast.distributed.fully_shard(_mlp(), mesh=mesh),
        "dpfast unchecked": dpfast.distributed.fully_shard(_mlp(), mesh=mesh, check_batch=False),
        "dpfast per-rank": dpfast.distributed.fully_shard(_mlp(), mesh=mesh, inputs="per_rank"),
        "dpfast gather": dpfast.distributed.fully_shard(_mlp(), mesh=mesh, gather_outputs=True),
    }

    def step(model, inputs, target, gather_by_hand=False):
        def run():
            model.zero_grad(set_to_none=True)
            out = model(inputs)
            if gather_by_hand:
                out = torch.cat(dist_nn.all_gather(out))
            F.cross_entropy(out, target).backward()

        return run

    return {
        "torch": step(torch_fsdp, xs, ys),
        "torch (again)": step(torch_fsdp, xs, ys),
        "dpfast": step(ours["dpfast"], x, ys),
        "dpfast unchecked": step(ours["dpfast unchecked"], x, ys),
        "dpfast per-rank": step(ours["dpfast per-rank"], xs, ys),
        "torch+gather": step(torch_gather, xs, y, gather_by_hand=True),
        "dpfast gather": step(ours["dpfast gather"], x, y),
    }


def _worker(rank: int, world: int, port: int, outdir: str, budget_s: float, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        samples = _timed(_steps(), budget_s, rounds)
        if rank == 0:
            with open(os.path.join(outdir, "result.json"), "w") as f:
                json.dump(samples, f)
    finally:
        dist.destroy_process_group()


def _spawned(world: int, budget_s: float, rounds: int) -> dict:
    """Seconds per step of every variant on ``world`` spawned ranks, and the ratios of RATIOS."""
    samples = spawn_ranks(_worker, world, budget_s, rounds)
    return {
        "seconds": {k: statistics.median(v) for k, v in samples.items()},
        "ratios": {f"{a}/{b}": _ratio(samples, a, b) for a, b in RATIOS},
    }


def run_fsdp(quick: bool, budget_s: float, rounds: int) -> dict:
    rounds = rounds if quick else 2 * rounds
    return {"ranks": WORLD, "steps": _spawned(WORLD, budget_s, rounds), "one rank": _spawned(1, budget_s, rounds)}


def print_fsdp(result: dict) -> None:
    print(
        f"\nfully_shard (FSDP2) training step: a 64-128-10 MLP at B = {BATCH}, gloo on this machine, 1 intra-op "
        "thread a rank; the variants' steps in turns, in a fresh order every step, medians"
    )
    for label, key in ((f"{result['ranks']} ranks", "steps"), ("one rank (no peer latency)", "one rank")):
        print(f"{label:<28} {'ms / step':>10}")
        for name, sec in result[key]["seconds"].items():
            print(f"  {name:<26} {1e3 * sec:>10.3f}")
        for ratio, value in result[key]["ratios"].items():
            verdict = "(noise floor)" if ratio.startswith("torch (again)") else f"target <= 1.10: {value <= 1.10}"
            print(f"  {ratio:<40} {value:>6.3f}   {verdict}")
