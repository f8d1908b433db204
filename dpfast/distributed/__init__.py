"""dpfast on ``torch.distributed``: :class:`DistributedDataParallel` (the same ``in_dims``/``out_dims`` as
``dpfast.DataParallel``; every rank given the global batch, or its own rows with ``inputs="per_rank"``) and
helpers for per-rank loading: :func:`shard_batch`, :func:`shard_range`, :func:`shard_dataset` (a rank's share of
a batch or dataset, cut as the wrapper cuts it) and :class:`BalancedBatchSampler` (shares of equal cost).

Modules: ``settings`` (the wrapper's settings, agreed at construction), ``agreement`` (what the ranks compare and
the error every rank raises), ``checks`` and ``bucket_check`` (when they compare it: inside collectives the step
runs anyway), ``sharding`` (a rank's share), ``sampler``, ``keeping_step`` (ranks without rows, ranks that cannot
run their part), ``exchanges``, ``output_layout`` and ``outputs`` (``gather_outputs``), ``module`` (the DDP
subclass).
"""

from __future__ import annotations

from .agreement import DistributedBatchError
from .module import DistributedDataParallel
from .sampler import BalancedBatchSampler
from .sharding import Share, shard_batch, shard_dataset, shard_range

__all__ = [
    "DistributedDataParallel",
    "DistributedBatchError",
    "BalancedBatchSampler",
    "Share",
    "shard_batch",
    "shard_range",
    "shard_dataset",
]
