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

# fmt: off
__all__ = ["transpose01", "state_to_batch_first", "state_to_layer_first", "split_contiguous", "scatter", "gather"]
# fmt: on


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
        *tensors: as :func:`dpfast.ops.transpose01` takes them.

    Returns:
        What :func:`dpfast.ops.transpose01` returns, bit for bit.

    Raises:
        TypeError, ValueError: where :func:`dpfast.ops.transpose01` raises them, with the same messages.
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
        state: as :func:`dpfast.ops.state_to_batch_first` takes it.

    Returns:
        What :func:`dpfast.ops.state_to_batch_first` returns, bit for bit.

    Raises:
        TypeError, ValueError: where :func:`dpfast.ops.state_to_batch_first` raises them.
    """
    return _map_state(state, "state_to_batch_first")


def state_to_layer_first(state: RNNState) -> RNNState:
    """The inverse of :func:`state_to_batch_first`, ``(B, L*D, H)`` to ``(L*D, B, H)``: the oracle of
    :func:`dpfast.ops.state_to_layer_first`. Args, Returns and Raises as there.

    Args:
        state: a batch-first state.

    Returns:
        It in torch's layout.

    Raises:
        TypeError, ValueError: as :func:`dpfast.ops.state_to_layer_first`.
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
        tensors: as :func:`dpfast.ops.split_contiguous` takes them.
        dim: as :func:`dpfast.ops.split_contiguous` takes it.
        sizes: as :func:`dpfast.ops.split_contiguous` takes them.

    Returns:
        What :func:`dpfast.ops.split_contiguous` returns, bit for bit.

    Raises:
        TypeError, IndexError, ValueError: where :func:`dpfast.ops.split_contiguous` raises them, with the same
            messages.
    """
    return _split(tensors, dim, sizes, "split_contiguous")


def scatter(
    tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
) -> list[list[Tensor]]:
    """The chunks of each tensor along ``dim``, chunk ``j`` on ``devices[j]``: the oracle of
    :func:`dpfast.ops.scatter` (here ``Tensor.split``, ``contiguous`` and ``to``).

    Args:
        tensors: as :func:`dpfast.ops.scatter` takes them.
        dim: as :func:`dpfast.ops.scatter` takes it.
        sizes: as :func:`dpfast.ops.scatter` takes them.
        devices: as :func:`dpfast.ops.scatter` takes them.

    Returns:
        What :func:`dpfast.ops.scatter` returns, bit for bit.

    Raises:
        TypeError, IndexError, ValueError, NotImplementedError, RuntimeError: where :func:`dpfast.ops.scatter` raises
            them, with the same messages.
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
        chunks: as :func:`dpfast.ops.gather` takes them.
        dim: as :func:`dpfast.ops.gather` takes it.
        device: as :func:`dpfast.ops.gather` takes it.

    Returns:
        What :func:`dpfast.ops.gather` returns, bit for bit.

    Raises:
        TypeError, IndexError, ValueError, NotImplementedError, RuntimeError: where :func:`dpfast.ops.gather` raises
            them, with the same messages.
    """
    dev = checks.as_device(device)
    dim = checks.as_dim("gather", dim)
    checks.check_tensors("gather", "chunks", chunks)
    d, _ = checks.check_gather(chunks, dim)
    checks.check_meta_copy("gather", "chunks", chunks, [dev])
    return torch.cat([_resolved(c).to(dev) for c in chunks], d)
