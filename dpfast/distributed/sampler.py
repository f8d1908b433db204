"""Per-rank loading with balanced work: :class:`BalancedBatchSampler`.

``torch.utils.data.DistributedSampler`` gives every rank the same *number* of samples per step; when samples
differ in cost (tokens, nodes, frames), the rank with the longest ones sets the pace of every step. This sampler
cuts each global batch of ``batch_size`` samples into the ranks' contiguous shares with the arithmetic of
``cost=`` (:func:`dpfast.plan.splits.balanced_split`: the largest share's cost is the least possible), so every
rank loads only its own samples and does about the same work. A rank's shares are exactly what
``shard_batch(global_batch, cost=...)`` would cut, so ``DistributedDataParallel(inputs="per_rank",
gather_outputs=True)`` gathers the global batch back in its order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..plan.costs import read_costs
from ..plan.splits import balanced_split
from .group import rank_weights, rank_world


class BalancedBatchSampler(torch.utils.data.Sampler):
    """A batch sampler for per-rank loading that balances cost across ranks at every step.

    Each epoch orders the dataset's indices (shuffled with ``seed + epoch`` when ``shuffle``, identically on every
    rank), cuts them into global batches of ``batch_size`` samples, and splits each global batch into ``world_size``
    contiguous shares that minimize the largest share's cost (relative to its ``chunk_sizes`` weight). This rank
    yields its share of each global batch, as a list of dataset indices: pass it as ``batch_sampler=`` to a
    ``DataLoader``. Every rank yields the same number of batches (a share may be empty when a global batch has
    fewer samples than ranks); no rank reads another rank's samples, only the costs.

    Args:
        costs: one number ``>= 0`` per dataset sample (a 1-D tensor, or a list/tuple/array): its length in tokens,
            its number of nodes... The same values ``cost=`` accepts.
        batch_size: samples per global batch (over all ranks together).
        rank: this rank (default: the initialized process group's).
        world_size: the number of ranks (default: the initialized process group's).
        chunk_sizes: relative weights per rank, as ``DataParallel``'s (a weight of 0 gets nothing).
        shuffle: shuffle the samples every epoch (call :meth:`set_epoch` at each epoch, as with
            ``DistributedSampler``); ``False`` keeps the dataset's order (e.g. already bucketed by length).
        seed: the shuffle's seed, the same on every rank.
        drop_last: drop the last global batch when it has fewer than ``batch_size`` samples.

    Raises:
        TypeError, ValueError: costs that are not finite numbers ``>= 0`` (naming the sample), a ``batch_size``
            that is not a positive int, a rank or world size out of range, bad ``chunk_sizes``.
    """

    def __init__(
        self,
        costs: Any,
        batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        chunk_sizes: Sequence[float] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (samples per global batch), got {batch_size!r}")
        self.rank, self.world_size = rank_world(rank, world_size)
        self.weights = rank_weights(chunk_sizes, self.world_size)
        self.costs = costs if isinstance(costs, torch.Tensor) else torch.as_tensor(_numbers(costs))
        if self.costs.dim() != 1:
            raise ValueError(f"costs must hold one number per sample (1-D), got shape {tuple(self.costs.shape)}")
        read_costs(self.costs, len(self.costs), "costs")  # every cost checked now, not at some later step
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (the same on every rank), as ``DistributedSampler.set_epoch`` does.

        Args:
            epoch: the epoch number; call it with the same value on every rank before each epoch.

        Raises:
            TypeError, ValueError: ``epoch`` is not an int (``int(epoch)`` fails).
        """
        self.epoch = int(epoch)

    def __len__(self) -> int:
        n = len(self.costs)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches, the same on every rank.

        Returns:
            One list of dataset indices per global batch of ``batch_size`` samples (the last may be shorter unless
            ``drop_last``), in order: shuffled with ``seed + epoch``, or the dataset's order.

        Raises:
            Nothing: the costs were checked by the constructor.
        """
        n = len(self.costs)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(n))
        return [order[i : i + self.batch_size] for i in range(0, len(self) * self.batch_size, self.batch_size)]

    def shares(self, batch: Sequence[int]) -> list[int]:
        """How many samples of one global batch each rank gets: contiguous shares of least maximal cost.

        Args:
            batch: dataset indices, in order (one of :meth:`global_batches`).

        Returns:
            One sample count per rank, summing to ``len(batch)`` (0 for a rank that gets none).

        Raises:
            IndexError: an index is out of the dataset's range.
        """
        costs = read_costs(self.costs[torch.as_tensor(batch, dtype=torch.long)], len(batch), "costs")
        return balanced_split(costs.prefix, self.world_size, self.weights)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            sizes = self.shares(batch)
            start = sum(sizes[: self.rank])
            yield batch[start : start + sizes[self.rank]]


def _numbers(costs: Any) -> Any:
    if hasattr(costs, "tolist") and not isinstance(costs, (list, tuple)):
        costs = costs.tolist()  # numpy
    if not isinstance(costs, (list, tuple)):
        raise TypeError(
            f"costs must be one number per sample (a 1-D tensor, or a list/tuple/array), got {type(costs).__name__}"
        )
    bad = next((i for i, c in enumerate(costs) if isinstance(c, bool) or not isinstance(c, (int, float))), None)
    if bad is not None:
        raise TypeError(f"costs: sample {bad} has cost {costs[bad]!r}; costs must be numbers")
    return costs
