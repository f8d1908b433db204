"""dpfast on ``torch.distributed``: :class:`DistributedDataParallel` (the same ``in_dims``/``out_dims`` as
``dpfast.DataParallel``, every rank given the global batch) and helpers for per-rank loading.

``sharding`` (a rank's share of a batch), ``collectives`` (the differentiable exchanges of ``gather_outputs``),
``agreement`` (all ranks got the same batch), ``outputs`` (gathering outputs across ranks), ``module`` (the DDP
subclass).
"""

from __future__ import annotations

from .agreement import DistributedBatchError
from .module import DistributedDataParallel
from .sharding import Share, shard_batch, shard_dataset, shard_range

__all__ = [
    "DistributedDataParallel",
    "DistributedBatchError",
    "Share",
    "shard_batch",
    "shard_range",
    "shard_dataset",
]
