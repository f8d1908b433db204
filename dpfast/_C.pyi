"""Types of the compiled extension ``dpfast._C`` (csrc/dpfast.cpp, csrc/python_calls.cpp, csrc/python_costs.cpp,
csrc/python_many.cpp, csrc/ddp_check_hook.cpp).

Importing it registers the ops as ``torch.ops.dpfast.*``. The underscored functions are the direct entry points
behind :mod:`dpfast.ops`: they take plain tensors and arguments and return ``NotImplemented`` for anything else
(a tensor subclass, an active ``__torch_function__`` mode), which dpfast.ops then sends through ``torch.ops``.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

cuda_kernels_compiled: int  # 1 when the CUDA kernels were compiled in
cuda_arch_list: str  # their TORCH_CUDA_ARCH_LIST ("" in a CPU-only build)
built_with_torch: str  # the torch release it was compiled against, "2.14.1"

# Any: the result, or NotImplemented
def _transpose01(*tensors: Tensor) -> Any: ...
def _split_contiguous(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> Any: ...
def _scatter(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[torch.device]) -> Any: ...
def _gather(chunks: Sequence[Tensor], dim: int, device: torch.device) -> Any: ...

# The exact arithmetic of cost= (csrc/python_costs.cpp; dpfast/plan/costs.py and plan/splits.py hold the reference).
# (first bad sample or -1, exponent of the common scale, (B + 1, 2) int64 prefix halves or None when too wide)
def _exact_prefix(costs: Tensor) -> tuple[int, int | None, Tensor | None]: ...
def _balanced_bounds(
    prefix: Tensor, mult: Sequence[int], targets: Sequence[int], lo_high: int, lo_low: int, hi_high: int, hi_low: int
) -> list[int]: ...

# A call's per-leaf work in one call each (csrc/python_many.cpp; dpfast/move/gather.py, dpfast/trees/facts.py,
# dpfast/plan/program.py and dpfast/distributed/ take their own path for whatever these decline).
# (per leaf its gathered tensor or None, per leaf whether its chunks follow `sizes`, all gathered and following)
def _gather_many(
    columns: Sequence[Sequence[Tensor]], dims: Sequence[int], device: torch.device, sizes: Sequence[int]
) -> Any: ...

# the tensors cut to rows start:start+length along their axes (-1: as they are), or NotImplemented
def _narrow_many(tensors: Sequence[Tensor], axes: Sequence[int], start: int, length: int) -> Any: ...

# (4 bytes a leaf: a plain tensor's dtype, dims and flags, zeros for any other leaf; the positions of the others),
# or NotImplemented (dpfast/trees/facts.py)
def _leaf_facts(leaves: Sequence[Any]) -> Any: ...

# the common size of leaves[where[k]] along axes[k], None when they differ, or NotImplemented (dpfast/plan/program.py)
def _batch_size(leaves: Sequence[Any], where: Sequence[int], axes: Sequence[int]) -> Any: ...

# A module tree's dicts checked and restored by identity (csrc/python_dicts.cpp; dpfast/run/shallow_snapshots.py
# does the same in Python for whatever these decline).
# whether every dicts[i] holds exactly keys[i] bound to values[i], in order, by identity; or NotImplemented.
# versions: 8 bytes a dict, kept with these very snapshots: a dict whose PEP 509 tag is the one recorded is not read
# again, and a dict found the same has its tag recorded (CPython < 3.12)
def _same_dicts(
    dicts: Sequence[dict], keys: Sequence[tuple], values: Sequence[tuple], versions: bytearray | None = ...
) -> Any: ...

# lives[i] cleared and updated from saved[i] (where it holds other entries); None, or NotImplemented
def _restore_dicts(lives: Sequence[dict], saved: Sequence[dict]) -> Any: ...

# DistributedDataParallel's per-step check as a C++ comm hook on DDP's reducer (csrc/ddp_check_hook.cpp;
# dpfast/distributed/bucket_check.py holds the Python hook it stands in for). The state is an opaque capsule.
def _ddp_check_install(
    reducer: Any, process_group: Any, rank: int, world: int, row_fn: Any, result_fn: Any
) -> object: ...
def _ddp_check_delegate(state: object, hook: Any) -> None: ...
def _ddp_check_read(state: object) -> None: ...
def _ddp_check_collectives(state: object) -> int: ...
