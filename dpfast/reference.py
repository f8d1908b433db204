"""The fused ops written in plain PyTorch: the oracle the kernels are tested against, and the fallback.

Every function here has the same signature and result structure as its twin in :mod:`dpfast.ops`.
Results are fresh contiguous tensors (never views of the inputs), as the fused ops guarantee.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
from torch import Tensor

DeviceLike = Union[int, str, torch.device]
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


def transpose01(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each input (dim >= 2) as ``x.transpose(0, 1).contiguous()``."""
    for i, x in enumerate(tensors):
        if x.dim() < 2:
            raise ValueError(
                f"transpose01: tensors[{i}] has shape {tuple(x.shape)} ({x.dim()} dims); every tensor needs at "
                "least 2 dims to swap dims 0 and 1"
            )
    return tuple(_fresh(x.transpose(0, 1)) for x in tensors)


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


def _check_sizes(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], op: str) -> list[int]:
    if len(tensors) == 0:
        return []
    sizes = [int(s) for s in sizes]
    for j, s in enumerate(sizes):
        if s < 0:
            raise ValueError(f"{op}: sizes[{j}] is {s}; chunk sizes must be >= 0")
    dev = tensors[0].device
    for i, x in enumerate(tensors):
        if x.device != dev:
            raise ValueError(
                f"{op}: tensors[{i}] is on {x.device} but tensors[0] is on {dev}; move all tensors to one device"
            )
        if x.dim() == 0:
            raise ValueError(f"{op}: tensors[{i}] is 0-dim; it has no dim {dim} to split")
        if not -x.dim() <= dim < x.dim():
            raise IndexError(
                f"{op}: dim {dim} is out of range for tensors[{i}] of shape {tuple(x.shape)} "
                f"(expected a dim in [{-x.dim()}, {x.dim() - 1}])"
            )
        if sum(sizes) != x.shape[dim]:
            raise ValueError(
                f"{op}: sizes {sizes} sum to {sum(sizes)} but tensors[{i}] has size {x.shape[dim]} along dim {dim} "
                f"(shape {tuple(x.shape)}); the sizes must sum to that axis"
            )
    return sizes


def split_contiguous(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> list[list[Tensor]]:
    """``out[i][j]`` is chunk ``j`` (of size ``sizes[j]`` along ``dim``) of ``tensors[i]``, contiguous."""
    sizes = _check_sizes(tensors, dim, sizes, "split_contiguous")
    return [[_fresh(c) for c in torch.split(x, sizes, dim)] for x in tensors]


def _as_device(d: DeviceLike) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    return torch.device(d)


def scatter(
    tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> list[list[Tensor]]:
    """``out[i][j]`` is chunk ``j`` of ``tensors[i]`` along ``dim``, contiguous, on ``devices[j]``."""
    if len(devices) != len(sizes):
        raise ValueError(
            f"scatter: got {len(sizes)} sizes but {len(devices)} devices; give one device per chunk size"
        )
    devs = [_as_device(d) for d in devices]
    chunks = split_contiguous(tensors, dim, sizes)
    return [[c if c.device == d else c.to(d) for c, d in zip(row, devs)] for row in chunks]


def gather(chunks: Sequence[Tensor], dim: int, device: DeviceLike) -> Tensor:
    """Concatenate ``chunks`` along ``dim`` on ``device``: the inverse of :func:`scatter`."""
    if len(chunks) == 0:
        raise ValueError("gather: chunks is empty; give at least one tensor to concatenate")
    ref = chunks[0]
    for i, c in enumerate(chunks):
        if c.dim() == 0:
            raise ValueError(f"gather: chunks[{i}] is 0-dim; it has no dim {dim} to concatenate along")
        if not -c.dim() <= dim < c.dim():
            raise IndexError(
                f"gather: dim {dim} is out of range for chunks[{i}] of shape {tuple(c.shape)} "
                f"(expected a dim in [{-c.dim()}, {c.dim() - 1}])"
            )
        if c.dim() != ref.dim() or c.dtype != ref.dtype or any(
            a != b for k, (a, b) in enumerate(zip(c.shape, ref.shape)) if k != dim % c.dim()
        ):
            raise ValueError(
                f"gather: chunks[{i}] has shape {tuple(c.shape)} and dtype {c.dtype} but chunks[0] has "
                f"{tuple(ref.shape)} and {ref.dtype}; chunks must agree in dtype and in every dim except {dim}"
            )
    dev = _as_device(device)
    return torch.cat([c.to(dev) for c in chunks], dim)
