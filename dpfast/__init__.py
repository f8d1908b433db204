"""dpfast: single-process multi-GPU data parallelism that is correct and fast.

``dpfast.DataParallel`` takes a scatter dimension per input and a gather dimension (or reduction) per output,
never drops a sample, and explains bad inputs. ``dpfast.ops`` holds the fused C++/CUDA data-movement ops,
``dpfast.reference`` the same ops in plain PyTorch.
"""

from __future__ import annotations

__version__ = "0.1.0"  # the one place the version is set (pyproject.toml reads it)

import importlib
from typing import TYPE_CHECKING

from . import _flat_layout, ops, reference
from .ext.loader import build_info

_flat_layout.install()  # objects pickled by the first layout name its module paths

if TYPE_CHECKING:  # what type checkers see; at run time these load on first use (_LAZY below)
    from . import distributed, integrations, nn
    from .data_parallel import DataParallel
    from .distributed import DistributedBatchError, DistributedDataParallel
    from .plan.call_plan import CallPlan
    from .plan.errors import ScatterError
    from .run.collectives import all_gather, all_reduce, replica_count, replica_index
    from .run.rendezvous import CollectiveError

__all__ = [
    "DataParallel",
    "CallPlan",
    "all_gather",
    "all_reduce",
    "replica_count",
    "replica_index",
    "DistributedDataParallel",
    "ScatterError",
    "CollectiveError",
    "DistributedBatchError",
    "build_info",
    "nn",
    "ops",
    "reference",
    "distributed",
    "integrations",
]

# The later stages load on first use, so `import dpfast` costs torch plus the ops (torch.distributed's process
# groups, DDP and transformers are only imported when something asks for them). name -> (module, attribute or
# None for the module itself); tests/test_public_api.py checks it against the TYPE_CHECKING imports above.
_LAZY = {
    "DataParallel": ("dpfast.data_parallel", "DataParallel"),
    "CallPlan": ("dpfast.plan.call_plan", "CallPlan"),
    "ScatterError": ("dpfast.plan.errors", "ScatterError"),
    "CollectiveError": ("dpfast.run.rendezvous", "CollectiveError"),
    "DistributedDataParallel": ("dpfast.distributed", "DistributedDataParallel"),
    "DistributedBatchError": ("dpfast.distributed", "DistributedBatchError"),
    "all_gather": ("dpfast.run.collectives", "all_gather"),
    "all_reduce": ("dpfast.run.collectives", "all_reduce"),
    "replica_index": ("dpfast.run.collectives", "replica_index"),
    "replica_count": ("dpfast.run.collectives", "replica_count"),
    "nn": ("dpfast.nn", None),
    "distributed": ("dpfast.distributed", None),
    "integrations": ("dpfast.integrations", None),
}

# Hidden from type checkers: a module __getattr__ they can see would make every misspelt `dpfast.X` an Any.
if not TYPE_CHECKING:

    def __getattr__(name: str):
        if name not in _LAZY:
            raise AttributeError(f"module 'dpfast' has no attribute {name!r}")
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
