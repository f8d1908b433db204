"""The ranks a ``DistributedDataParallel`` works with: its process group, this rank and the world size, the device
its collectives' buffers live on (:class:`RankGroup`), and ``rank``/``world_size``/``chunk_sizes`` checked as the
public helpers take them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..plan.splits import validate_chunk_sizes


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """The process group a DDP module talks over, and the device its collectives' buffers live on."""

    process_group: Any
    rank: int
    world: int
    comm_device: torch.device

    def on_host(self) -> RankGroup:
        """The same ranks with CPU buffers, for a check whose result the host reads at once: reading a CUDA result
        waits for every kernel queued before it (the last step's backward and optimizer step). A process group
        whose backend takes CPU tensors (gloo, or ``"cpu:gloo,cuda:nccl"``) serves as it is; otherwise a gloo group
        of the same ranks is made, by those ranks together (a group of one, whose checks run no collective, and a
        torch without gloo keep the group as it is)."""
        host = torch.device("cpu")
        if self.comm_device.type == "cpu" or self.world == 1 or not dist.is_gloo_available():
            return self
        if "gloo" in str(dist.get_backend(self.process_group)):
            return dataclasses.replace(self, comm_device=host)
        ranks = dist.get_process_group_ranks(self.process_group)
        pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return dataclasses.replace(self, process_group=pg, comm_device=host)


def rank_world(rank: int | None, world_size: int | None, group=None) -> tuple[int, int]:
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "rank and world_size are needed when torch.distributed is not initialized "
                "(call torch.distributed.init_process_group first, or pass them)"
            )
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size


def rank_weights(chunk_sizes: Sequence[float] | None, world_size: int) -> list | None:
    """``chunk_sizes`` checked as one relative weight per rank (exact fractions), or ``None``."""
    try:
        return validate_chunk_sizes(chunk_sizes, world_size)
    except ValueError:
        n = len(chunk_sizes) if hasattr(chunk_sizes, "__len__") else world_size  # (its message says device_ids)
        if n != world_size:
            raise ValueError(
                f"chunk_sizes has {n} weights but there are {world_size} ranks; give one weight per rank (0 gives "
                "a rank no rows)"
            ) from None
        raise
