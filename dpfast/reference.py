"""The fused ops written in plain PyTorch: the oracle the kernels are tested against, and the fallback.

Every function here has the same signature and result structure as its twin in :mod:`dpfast.ops`.
Results are fresh contiguous tensors (never views of the inputs), as the fused ops guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

from .ext import op_checks as checks
from .ext.op_checks import DeviceLike

# An RNN state as the state conversions take it, and give it back: a tensor (GRU, RNN), an LSTM's (h, c), any
# tuple or list of tensors. A TypeVar, so that a type checker knows `h, c = state_to_batch_first((h, c))`.
RNNState = TypeVar("RNNState", Tensor, tuple[Tensor, Tensor], tuple[Tensor, ...], list[Tensor])

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
    """Each input as ``x.transpose(0, 1).contiguous()``, in plain PyTorch: the oracle of :func:`dpfast.ops.transpose01`.

    Args:
        *tensors: tensors of 2 or more dims, all on one device; any dtype, any strides.

    Returns:
        One fresh contiguous tensor per input (never the input itself, nor a view of it), dims 0 and 1 swapped;
        ``()`` for no input.

    Raises:
        TypeError: an argument is not a Tensor.
        ValueError: a tensor has fewer than 2 dims, or the tensors are on different devices.
    """
    checks.check_tensors("transpose01", "tensors", tensors)
    checks.check_transpose01(tensors)
    return tuple(_fresh(_resolved(x).transpose(0, 1)) for x in tensors)


def _map_state(state: Any, name: str, transpose: Callable[..., tuple] = transpose01) -> Any:
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


def state_to_batch_first(state: RNNState) -> RNNState:
    """RNN state ``(L*D, B, H)`` (or an ``(h, c)`` tuple of them) to ``(B, L*D, H)``: the oracle of
    :func:`dpfast.ops.state_to_batch_first`.

    Args:
        state: a GRU/RNN state tensor, or an LSTM's ``(h, c)`` (any non-empty tuple or list of tensors).

    Returns:
        The same structure (a Tensor, a tuple, a list) of fresh tensors with dims 0 and 1 swapped.

    Raises:
        TypeError: ``state`` is neither a Tensor nor a non-empty tuple/list of Tensors.
        ValueError: a tensor has fewer than 2 dims, or the tensors are on different devices.
    """
    return _map_state(state, "state_to_batch_first")


def state_to_layer_first(state: RNNState) -> RNNState:
    """RNN state ``(B, L*D, H)`` (or an ``(h, c)`` tuple of them) to ``(L*D, B, H)``: the inverse of
    :func:`state_to_batch_first`, the oracle of :func:`dpfast.ops.state_to_layer_first`.

    Args:
        state: a batch-first GRU/RNN state tensor, or an LSTM's ``(h, c)`` (any non-empty tuple or list of tensors).

    Returns:
        The same structure (a Tensor, a tuple, a list) of fresh tensors with dims 0 and 1 swapped.

    Raises:
        TypeError: ``state`` is neither a Tensor nor a non-empty tuple/list of Tensors.
        ValueError: a tensor has fewer than 2 dims, or the tensors are on different devices.
    """
    return _map_state(state, "state_to_layer_first")


def _split(tensors: Sequence[Tensor], dim: Any, sizes: Any, op: str) -> list[list[Tensor]]:
    dim = checks.as_dim(op, dim)
    sizes = checks.as_sizes(op, sizes)
    checks.check_tensors(op, "tensors", tensors)
    dims = checks.check_split(op, tensors, dim, sizes)
    return [[_fresh(c) for c in torch.split(_resolved(x), sizes, d)] for x, d in zip(tensors, dims)]


def split_contiguous(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> list[list[Tensor]]:
    """The chunks of each tensor along ``dim``, each contiguous: the oracle of :func:`dpfast.ops.split_contiguous`.

    Args:
        tensors: the tensors to split, all on one device (their dtypes and ranks may differ).
        dim: the axis to split; a negative ``dim`` counts from the end of each tensor.
        sizes: the chunk sizes (ints >= 0, zeros allowed), summing to every tensor's size along ``dim``.

    Returns:
        ``out[i][j]``: chunk ``j`` (``sizes[j]`` long along ``dim``) of ``tensors[i]``, a fresh contiguous tensor.

    Raises:
        TypeError: ``dim`` or a size is not an int (a bool, a float), ``sizes`` is not an iterable of ints, or an
            element of ``tensors`` is not a Tensor.
        IndexError: ``dim`` is out of range for one of the tensors.
        ValueError: a size is negative, the sizes do not sum to a tensor's size along ``dim``, a tensor is 0-dim,
            or the tensors are on different devices.
    """
    return _split(tensors, dim, sizes, "split_contiguous")


def scatter(
    tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> list[list[Tensor]]:
    """The chunks of each tensor along ``dim``, chunk ``j`` on ``devices[j]``: the oracle of
    :func:`dpfast.ops.scatter` (here a split, then ``Tensor.to`` per chunk).

    Args:
        tensors: the tensors to split, all on one device.
        dim: the axis to split; a negative ``dim`` counts from the end of each tensor.
        sizes: one chunk size per device (ints >= 0), summing to every tensor's size along ``dim``.
        devices: one destination per chunk: ``torch.device``, ``"cuda:1"``, ``"cpu"``, or an int (a CUDA index).

    Returns:
        ``out[i][j]``: chunk ``j`` of ``tensors[i]``, a fresh contiguous tensor on ``devices[j]``.

    Raises:
        TypeError: as :func:`split_contiguous`, or a device is not an int, str or ``torch.device``.
        IndexError: ``dim`` is out of range for one of the tensors.
        ValueError: as :func:`split_contiguous`, or ``sizes`` and ``devices`` differ in length.
        NotImplementedError: a meta tensor would be copied to a real device (it holds no data).
        RuntimeError: torch cannot use a device (an unknown device string, a CUDA device that is not there).
    """
    devs = [checks.as_device(d) for d in devices]
    dim, sizes = checks.as_dim("scatter", dim), checks.as_sizes("scatter", sizes)
    checks.check_scatter(sizes, devs)
    chunks = _split(tensors, dim, sizes, "scatter")
    checks.check_meta_copy("scatter", "tensors", tensors, devs)
    return [[c if c.device == d else c.to(d) for c, d in zip(row, devs)] for row in chunks]


def gather(chunks: Sequence[Tensor], dim: int, device: DeviceLike) -> Tensor:
    """Concatenate ``chunks`` along ``dim`` on ``device``: the inverse of :func:`scatter`, the oracle of
    :func:`dpfast.ops.gather` (here ``torch.cat`` of the chunks moved to ``device``).

    Args:
        chunks: one or more tensors of one dtype and rank, equal in every dim but ``dim``, on any devices.
        dim: the axis to concatenate; a negative ``dim`` counts from the end.
        device: where the result goes: ``torch.device``, ``"cuda:1"``, ``"cpu"``, or an int (a CUDA index).

    Returns:
        A fresh contiguous tensor on ``device``, the chunks in order along ``dim``.

    Raises:
        TypeError: ``dim`` is not an int, ``device`` is not a device, or a chunk is not a Tensor.
        IndexError: ``dim`` is out of range for a chunk.
        ValueError: ``chunks`` is empty, a chunk is 0-dim, or the chunks differ in dtype, rank, or a dim other
            than ``dim``.
        NotImplementedError: a meta chunk would be copied to a real device (it holds no data).
        RuntimeError: torch cannot use ``device`` (an unknown device string, a CUDA device that is not there).
    """
    dev = checks.as_device(device)
    dim = checks.as_dim("gather", dim)
    checks.check_tensors("gather", "chunks", chunks)
    d, _ = checks.check_gather(chunks, dim)
    checks.check_meta_copy("gather", "chunks", chunks, [dev])
    return torch.cat([_resolved(c).to(dev) for c in chunks], d)
