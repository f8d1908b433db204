"""Per-rank loading's balance (``bench_dp.py --section ddp``, beside the DDP step rows of
:mod:`dp_distributed`).

**Balance.** Long-tailed per-sample costs (token counts), 4 ranks, 16 samples per rank and step: the slowest rank's
cost over the mean rank's, per step, with ``torch.utils.data.DistributedSampler`` (+ ``BatchSampler``) against
``dpfast.distributed.BalancedBatchSampler`` (global batches of 64), for a shuffled dataset and a length-bucketed
one; and the epoch's cost when every step waits for its slowest rank.
"""

from __future__ import annotations

import statistics

import torch

from dpfast.distributed import BalancedBatchSampler


def _token_counts(n: int, seed: int = 0) -> torch.Tensor:
    """Long-tailed sequence lengths (log-normal, median about 55 tokens, a tail to 2048)."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(4.0 + 0.9 * torch.randn(n, generator=g)).long().clamp(1, 2048)


def _bucketed(costs: torch.Tensor, chunk: int, seed: int = 0) -> torch.Tensor:
    """A length-bucketed order: sorted by length within chunks of ``chunk`` samples, the chunks shuffled."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(costs), generator=g)
    chunks = [c[torch.argsort(costs[c])] for c in order.split(chunk)]
    return torch.cat([chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()])


def _step_shares(batches_per_rank: list, costs: torch.Tensor) -> list[list[int]]:
    return [[int(costs[b].sum()) for b in step] for step in zip(*batches_per_rank)]


def _summary(steps: list[list[int]]) -> dict:
    slow = sorted(max(s) / (sum(s) / len(s)) for s in steps)
    return {
        "slowest/mean (mean over steps)": statistics.fmean(slow),
        "slowest/mean (p95)": slow[int(0.95 * (len(slow) - 1))],
        "epoch cost (sum of slowest)": sum(max(s) for s in steps),
    }


def run_balance(world: int = 4, per_rank: int = 16, n: int = 16384) -> dict:
    """DistributedSampler against BalancedBatchSampler on shuffled and length-bucketed long-tailed costs."""
    rows = {}
    for order_name in ("shuffled", "length-bucketed"):
        costs = _token_counts(n)
        if order_name == "length-bucketed":
            costs = costs[_bucketed(costs, 50 * world * per_rank)]
        shuffle = order_name == "shuffled"
        dataset = list(range(n))
        theirs = [
            list(
                torch.utils.data.BatchSampler(
                    torch.utils.data.DistributedSampler(dataset, world, r, shuffle=shuffle, seed=0), per_rank, True
                )
            )
            for r in range(world)
        ]
        ours = [
            list(BalancedBatchSampler(costs, world * per_rank, r, world, shuffle=shuffle, seed=0, drop_last=True))
            for r in range(world)
        ]
        a, b = _summary(_step_shares(theirs, costs)), _summary(_step_shares(ours, costs))
        rows[order_name] = {
            "DistributedSampler": a,
            "BalancedBatchSampler": b,
            "epoch cost ratio": b["epoch cost (sum of slowest)"] / a["epoch cost (sum of slowest)"],
        }
    return {"world": world, "per_rank_batch": per_rank, "samples": n, "rows": rows}
