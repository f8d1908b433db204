"""The fused ops written in plain PyTorch: the oracle the kernels are tested against, and the fallback.

Every function here has the same signature and result structure as its twin in :mod:`dpfast.ops`.
Results are fresh contiguous tensors (never views of the inputs), as the fused ops guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Union

import torch
from torch import Tensor

from .ext import op_checks as checks
from .ext.op_checks import DeviceLike

State = Union[Tensor, tuple]

__all__ = [
    "transpose01",
    "state_to_batch_first",
    "state_to_layer_first",
    "split_contiguous",
    "scatter",
    "gather",
]


def _fresh(x: Tensor) -> Tensor:
    # .contiguous() returns the input itself when it already is contiguous; the ops never alias.
    return x.clone(memory_format=torch.contiguous_format)


def _resolved(x: Tensor) -> Tensor:
    # Lazy conjugation/negation bits resolved the way the C++ ops resolve them (csrc/math_bits.cpp): torch's other
    # negation path quiets signalling NaNs of half-precision types differently.
    return x.resolve_conj().resolve_neg()


def transpose01(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each input (dim >= 2) as ``x.transpose(0, 1).contiguous()``."""
    checks.check_tensors("transpose01", "tensors", tensors)
    checks.check_transpose01(tensors)
    return tuple(_fresh(_resolved(x).transpose(0, 1)) for x in tensors)


def _map_state(state: State, name: str, transpose: Callable[..., tuple] = transpose01) -> State:
    """Apply ``transpose`` (a transpose01) to an RNN state: a Tensor, or a tuple/list of Tensors such as (h, c),
    all in one call; the structure comes back as given. Shared with :mod:`dpfast.ops`."""
    if isinstance(state, Tensor):
        return transpose(state)[0]
    if isinstance(state, (tuple, list)) and len(state) > 0 and all(isinstance(s, Tensor) for s in state):
        out = transpose(*state)
        return list(out) if isinstance(state, list) else tuple(out)
    raise TypeError(
        f"{name}: state must be a Tensor (GRU/RNN) or a tuple of Tensors such as (h, c) (LSTM), "
        f"got {type(state).__name__}"
    )


def state_to_batch_first(state: State) -> State:
    """RNN state ``(L*D, B, H)`` (or an ``(h, c)`` tuple of them) to ``(B, L*D, H)``."""
    return _map_state(state, "state_to_batch_first")


def state_to_layer_first(state: State) -> State:
    """RNN state ``(B, L*D, H)`` (or an ``(h, c)`` tuple of them) to ``(L*D, B, H)``."""
    return _map_state(state, "state_to_layer_first")


def _split(tensors: Sequence[Tensor], dim: Any, sizes: Any, op: str) -> list[list[Tensor]]:
    dim = checks.as_dim(op, dim)
    sizes = checks.as_sizes(op, sizes)
    checks.check_tensors(op, "tensors", tensors)
    dims = checks.check_split(op, tensors, dim, sizes)
    return [[_fresh(c) for c in torch.split(_resolved(x), sizes, d)] for x, d in zip(tensors, dims)]


def split_contiguous(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> list[list[Tensor]]:
    """``out[i][j]`` is chunk ``j`` (of size ``sizes[j]`` along ``dim``) of ``tensors[i]``, contiguous."""
    return _split(tensors, dim, sizes, "split_contiguous")


def scatter(
    tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> list[list[Tensor]]:
    """``out[i][j]`` is chunk ``j`` of ``tensors[i]`` along ``dim``, contiguous, on ``devices[j]``."""
    devs = [checks.as_device(d) for d in devices]
    dim, sizes = checks.as_dim("scatter", dim), checks.as_sizes("scatter", sizes)
    checks.check_scatter(sizes, devs)
    chunks = _split(tensors, dim, sizes, "scatter")
    checks.check_meta_copy("scatter", "tensors", tensors, devs)
    return [[c if c.device == d else c.to(d) for c, d in zip(row, devs)] for row in chunks]


def gather(chunks: Sequence[Tensor], dim: int, device: DeviceLike) -> Tensor:
    """Concatenate ``chunks`` along ``dim`` on ``device``: the inverse of :func:`scatter`."""
    dev = checks.as_device(device)
    dim = checks.as_dim("gather", dim)
    checks.check_tensors("gather", "chunks", chunks)
    d, _ = checks.check_gather(chunks, dim)
    checks.check_meta_copy("gather", "chunks", chunks, [dev])
    return torch.cat([_resolved(c).to(dev) for c in chunks], d)
