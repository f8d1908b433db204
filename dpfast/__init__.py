"""dpfast: single-process multi-GPU data parallelism that is correct and fast.

``dpfast.DataParallel`` takes a scatter dimension per input and a gather dimension (or reduction) per output,
never drops a sample, and explains bad inputs. ``dpfast.ops`` holds the fused C++/CUDA data-movement ops,
``dpfast.reference`` the same ops in plain PyTorch.
"""

from __future__ import annotations

__version__ = "0.1.0"  # the one place the version is set (pyproject.toml reads it)

import importlib
from typing import Any

from . import _flat_layout, ops, reference
from .ext.loader import build_info

_flat_layout.install()  # objects pickled by the first layout name its module paths

__all__ = [
    "DataParallel",
    "all_gather",
    "all_reduce",
    "replica_count",
    "replica_index",
    "DistributedDataParallel",
    "ScatterError",
    "build_info",
    "nn",
    "ops",
    "reference",
]

# Heavier pieces load on first use, so `import dpfast` stays cheap (and torch.distributed is only touched by DDP).
_LAZY = {
    "DataParallel": ("dpfast.data_parallel", "DataParallel"),
    "ScatterError": ("dpfast.plan.errors", "ScatterError"),
    "DistributedDataParallel": ("dpfast.distributed", "DistributedDataParallel"),
    "nn": ("dpfast.nn", None),
    "all_gather": ("dpfast.run.collectives", "all_gather"),
    "all_reduce": ("dpfast.run.collectives", "all_reduce"),
    "replica_index": ("dpfast.run.collectives", "replica_index"),
    "replica_count": ("dpfast.run.collectives", "replica_count"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dpfast' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
