"""dpfast.distributed.BalancedBatchSampler: per-rank shares of every global batch, balanced by cost with the
arithmetic of cost= (no process group needed: rank and world_size are given)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dpfast.distributed import BalancedBatchSampler, shard_batch
from dpfast.plan.splits import balanced_split, validate_chunk_sizes


def _skewed(n, seed=0):
    """Long-tailed costs (sequence lengths): a few long samples, many short ones."""
    g = torch.Generator().manual_seed(seed)
    return (4 + 400 * torch.rand(n, generator=g) ** 4).long()


def _epoch(costs, batch, world, **kw):
    return [list(BalancedBatchSampler(costs, batch, r, world, **kw)) for r in range(world)]


@pytest.mark.parametrize("world, batch, n", [(2, 8, 37), (3, 5, 30), (4, 3, 10), (3, 16, 16)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shares_partition_every_global_batch_in_order(world, batch, n, shuffle):
    costs = _skewed(n)
    per_rank = _epoch(costs, batch, world, shuffle=shuffle)
    globals_ = BalancedBatchSampler(costs, batch, 0, world, shuffle=shuffle).global_batches()
    assert all(len(steps) == len(globals_) for steps in per_rank), "every rank runs the same number of steps"
    for step, global_batch in enumerate(globals_):
        assert [i for r in range(world) for i in per_rank[r][step]] == global_batch  # rank order = batch order
    seen = [i for steps in per_rank for b in steps for i in b]
    assert sorted(seen) == list(range(n))  # every sample exactly once per epoch, none dropped


@pytest.mark.parametrize("world, weights", [(2, None), (3, None), (3, [1, 0, 2]), (4, [2, 1, 1, 1])])
def test_each_split_is_the_cost_split_that_shard_batch_makes(world, weights):
    costs = _skewed(40, seed=world)
    sampler = BalancedBatchSampler(costs, 10, 0, world, chunk_sizes=weights, seed=1)
    per_rank = [list(BalancedBatchSampler(costs, 10, r, world, chunk_sizes=weights, seed=1)) for r in range(world)]
    for step, batch in enumerate(sampler.global_batches()):
        c = costs[batch]
        prefix = [0] + c.cumsum(0).tolist()
        sizes = balanced_split(prefix, world, validate_chunk_sizes(weights, world))
        assert [len(per_rank[r][step]) for r in range(world)] == sizes
        for r in range(world):  # the same rows shard_batch(..., cost=) cuts from the global batch
            part = shard_batch({"i": torch.tensor(batch), "c": c}, r, world, chunk_sizes=weights, cost="batch['c']")
            assert part["i"].tolist() == per_rank[r][step]


def test_the_largest_share_is_optimal_among_contiguous_splits():
    costs = _skewed(12, seed=5)
    world = 3
    sampler = BalancedBatchSampler(costs, 12, 0, world, shuffle=False)
    batch = sampler.global_batches()[0]
    got = max(_share_costs(costs, batch, sampler.shares(batch)))
    best = min(
        max(_share_costs(costs, batch, [a, b - a, len(batch) - b]))
        for a, b in itertools.combinations_with_replacement(range(len(batch) + 1), 2)
    )
    assert got == best


def _share_costs(costs, batch, sizes):
    out, start = [], 0
    for s in sizes:
        out.append(int(costs[batch[start : start + s]].sum()))
        start += s
    return out


def test_slowest_rank_carries_less_than_with_distributed_sampler():
    """The point of it: on long-tailed costs, the slowest rank's share of a step is much closer to 1/world than
    DistributedSampler's (the same samples per step: batch_size per rank x world)."""
    costs, world, per_rank_batch = _skewed(4096, seed=2), 4, 8
    ours = []
    sampler = BalancedBatchSampler(costs, world * per_rank_batch, 0, world, seed=0, drop_last=True)
    for batch in sampler.global_batches():
        shares = _share_costs(costs, batch, sampler.shares(batch))
        ours.append(max(shares) / sum(shares))
    theirs = []
    dataset = list(range(len(costs)))
    loaders = [
        list(
            torch.utils.data.BatchSampler(
                torch.utils.data.DistributedSampler(dataset, world, r, shuffle=True, seed=0), per_rank_batch, True
            )
        )
        for r in range(world)
    ]
    for step in range(min(map(len, loaders))):
        shares = [int(costs[loaders[r][step]].sum()) for r in range(world)]
        theirs.append(max(shares) / sum(shares))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(ours) < 1 / world + 0.5 * (mean(theirs) - 1 / world), (mean(ours), mean(theirs))


def test_shuffle_is_the_same_on_every_rank_and_changes_with_the_epoch():
    costs = _skewed(50)
    a, b = BalancedBatchSampler(costs, 7, 0, 2, seed=3), BalancedBatchSampler(costs, 7, 1, 2, seed=3)
    assert a.global_batches() == b.global_batches()
    first = a.global_batches()
    a.set_epoch(1)
    assert a.global_batches() != first
    assert sorted(i for batch in a.global_batches() for i in batch) == list(range(50))
    assert BalancedBatchSampler(costs, 7, 0, 2, shuffle=False).global_batches()[0] == list(range(7))


def test_drop_last_and_len():
    costs = torch.ones(10)
    assert len(BalancedBatchSampler(costs, 4, 0, 2)) == 3
    assert len(BalancedBatchSampler(costs, 4, 0, 2, drop_last=True)) == 2
    assert [len(b) for b in BalancedBatchSampler(costs, 4, 1, 2, shuffle=False)] == [2, 2, 1]
    # 3 samples on 4 ranks: the last rank's shares are empty (and so is every share of the last, 1-sample batch)
    assert [len(b) for b in BalancedBatchSampler(costs, 3, 3, 4, shuffle=False)] == [0, 0, 0, 0]
    assert [len(b) for b in BalancedBatchSampler(costs, 3, 0, 4, shuffle=False)] == [1, 1, 1, 1]


def test_works_as_a_dataloader_batch_sampler():
    data = torch.arange(20).float()
    costs = [1 + i % 5 for i in range(20)]
    loader = torch.utils.data.DataLoader(data, batch_sampler=BalancedBatchSampler(costs, 6, 1, 2, seed=0))
    got = torch.cat(list(loader)).long().tolist()
    assert got == [i for b in BalancedBatchSampler(costs, 6, 1, 2, seed=0) for i in b]


@pytest.mark.parametrize(
    "costs, kwargs, error, match",
    [
        ([1, -2, 3], {}, ValueError, "sample 1 has cost -2"),
        ([1.0, float("nan")], {}, ValueError, "finite"),
        (["a", 1], {}, TypeError, "sample 0 has cost 'a'"),
        ([[1, 2]], {}, TypeError, r"sample 0 has cost \[1, 2\]"),
        (torch.ones(2, 2), {}, ValueError, "1-D"),
        ([1, 2], {"batch_size": 0}, ValueError, "batch_size must be a positive int"),
        ([1, 2], {"rank": 2}, ValueError, "rank must be"),
        ([1, 2], {"chunk_sizes": [1, 2, 3]}, ValueError, "3 weights but there are 2 ranks"),
    ],
)
def test_bad_arguments_name_what_is_wrong(costs, kwargs, error, match):
    args = {"batch_size": 2, "rank": 0, "world_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        BalancedBatchSampler(costs, args.pop("batch_size"), **args)


def test_needs_rank_and_world_size_without_a_process_group():
    with pytest.raises(ValueError, match="rank and world_size"):
        BalancedBatchSampler([1, 2], 2)
