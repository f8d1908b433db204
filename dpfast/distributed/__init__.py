"""dpfast on ``torch.distributed``: :class:`DistributedDataParallel` (the same ``in_dims``/``out_dims`` as
``dpfast.DataParallel``; every rank given the global batch, or its own rows with ``inputs="per_rank"``) and
helpers for per-rank loading: :func:`shard_batch`, :func:`shard_range`, :func:`shard_dataset` (a rank's share of
a batch or dataset, cut as the wrapper cuts it) and :class:`BalancedBatchSampler` (shares of equal cost).

Modules, by concept: ``group`` (the ranks), ``settings`` (the wrapper's settings, agreed at construction),
``agreement`` (what the ranks compare, when, and the error every rank raises) and ``bucket_check`` (the check in
DDP's first gradient bucket), ``inputs`` (a rank's share of a call and the per-rank loading helpers), the outputs
(``output_layout``, ``outputs``: the exchange, ``output_adjoint``), ``empty_ranks`` (ranks without rows or that cannot
run their part), ``sampler``, ``module`` (the DDP subclass) and ``sharded`` (the same on FSDP2:
:func:`fully_shard`).
"""

from __future__ import annotations

from .disagreement import DistributedBatchError
from .inputs import Share, shard_batch, shard_dataset, shard_range
from .module import DistributedDataParallel
from .sampler import BalancedBatchSampler
from .sharded import fully_shard

__all__ = [
    "DistributedDataParallel",
    "fully_shard",
    "DistributedBatchError",
    "BalancedBatchSampler",
    "Share",
    "shard_batch",
    "shard_range",
    "shard_dataset",
]
