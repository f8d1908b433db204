"""The fused data-movement ops: thin typed wrappers over ``torch.ops.dpfast.*``, plus their fake kernels.

Kernels (CPU and CUDA) and autograd live in C++ (``csrc/``) so that a call costs one dispatcher round trip.
The fake kernels here let the ops run under ``torch.compile(fullgraph=True)``. Without the compiled extension
every function falls back to :mod:`dpfast.reference`, which gives the same results.

Result layout: ``split_contiguous`` and ``scatter`` return ``out[i][j]``, chunk ``j`` of ``tensors[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

from . import reference
from .ext import op_checks as checks
from .ext.loader import LOADED
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


as_device = checks.as_device


def _unflatten(op: str, flat: Sequence[Tensor], n_tensors: int, n_chunks: int) -> list[list[Tensor]]:
    if len(flat) != n_tensors * n_chunks:  # a kernel or TorchDispatchMode may return any number of tensors
        raise RuntimeError(
            f"dpfast::{op} returned {len(flat)} tensors where {n_tensors * n_chunks} were expected; a kernel or "
            "TorchDispatchMode handling dpfast ops must return one tensor per output"
        )
    return [list(flat[i * n_chunks : (i + 1) * n_chunks]) for i in range(n_tensors)]


if LOADED:
    from .ext.loader import C as _C

    _transpose01 = torch.ops.dpfast.transpose01.default
    _split = torch.ops.dpfast.split_contiguous.default
    _scatter = torch.ops.dpfast.scatter.default
    _gather = torch.ops.dpfast.gather.default
    # Direct entry points (csrc/python_calls.cpp), cheaper than torch.ops' boxed path. They take plain tensors and
    # arguments and return NotImplemented for anything else (a subclass, a __torch_function__ mode, a numpy int),
    # which then goes through torch.ops after the same argument conversions the reference makes.
    # torch.compile traces the torch.ops path.
    _fast_transpose01 = _C._transpose01
    _fast_split = _C._split_contiguous
    _fast_scatter = _C._scatter
    _fast_gather = _C._gather
    _compiling = torch.compiler.is_compiling

    def transpose01(*tensors: Tensor) -> tuple[Tensor, ...]:
        """Each input (dim >= 2) as ``x.transpose(0, 1).contiguous()``, all in one kernel launch."""
        if not _compiling():
            out = _fast_transpose01(*tensors)
            if out is not NotImplemented:
                return out
        # The dispatcher picks a kernel from the tensors, so an empty call never reaches C++.
        if not tensors:
            return ()
        checks.check_tensors("transpose01", "tensors", tensors)
        out = _transpose01(tensors)
        if len(out) != len(tensors):
            _unflatten("transpose01", out, len(tensors), 1)  # raises
        return tuple(out)

    def split_contiguous(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> list[list[Tensor]]:
        """``out[i][j]``: chunk ``j`` (``sizes[j]`` long along ``dim``) of ``tensors[i]``, contiguous; one launch."""
        if not _compiling():
            out = _fast_split(tensors, dim, sizes)
            if out is not NotImplemented:
                return out
        dim, sizes = checks.as_dim("split_contiguous", dim), checks.as_sizes("split_contiguous", sizes)
        if not tensors:
            return reference.split_contiguous(tensors, dim, sizes)
        checks.check_tensors("split_contiguous", "tensors", tensors)
        return _unflatten("split_contiguous", _split(tensors, dim, sizes), len(tensors), len(sizes))

    def scatter(
        tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
    ) -> list[list[Tensor]]:
        """``out[i][j]``: chunk ``j`` of ``tensors[i]`` along ``dim``, contiguous, on ``devices[j]``.

        Chunks are packed on the source device in one launch, then copied asynchronously to their devices (one
        side stream per destination GPU), ordered against the current streams of both. Backward gathers the
        gradients onto the source.
        """
        devices = [as_device(d) for d in devices]
        if not _compiling():
            out = _fast_scatter(tensors, dim, sizes, devices)
            if out is not NotImplemented:
                return out
        dim, sizes = checks.as_dim("scatter", dim), checks.as_sizes("scatter", sizes)
        if not tensors:
            return reference.scatter(tensors, dim, sizes, devices)
        checks.check_scatter(sizes, devices)
        checks.check_tensors("scatter", "tensors", tensors)
        return _unflatten("scatter", _scatter(tensors, dim, sizes, devices), len(tensors), len(sizes))

    def gather(chunks: Sequence[Tensor], dim: int, device: DeviceLike) -> Tensor:
        """Concatenate ``chunks`` along ``dim`` on ``device`` (the inverse of :func:`scatter`)."""
        device = as_device(device)
        if not _compiling():
            out = _fast_gather(chunks, dim, device)
            if out is not NotImplemented:
                return out
        dim = checks.as_dim("gather", dim)
        if not chunks:
            return reference.gather(chunks, dim, device)  # raises the error that names the problem
        checks.check_tensors("gather", "chunks", chunks)
        return _gather(chunks, dim, device)

    # ---- fake kernels: shapes, dtypes and devices only, for torch.compile / FakeTensor tracing and meta tensors.
    # They check what the C++ kernels check, with the same messages, and never make a tensor with data (a CPU
    # tensor) out of meta inputs: that raises, as Tensor.to does.

    def _chunk_shapes(x: Tensor, d: int, sizes: Sequence[int]) -> list[list]:
        shapes = []
        for s in sizes:
            shape = list(x.shape)
            shape[d] = s
            shapes.append(shape)
        return shapes

    @torch.library.register_fake("dpfast::transpose01")
    def _(xs: list[Tensor]) -> list[Tensor]:
        checks.check_transpose01(xs)
        outs = []
        for x in xs:
            shape = list(x.shape)
            shape[0], shape[1] = shape[1], shape[0]
            outs.append(x.new_empty(shape))
        return outs

    @torch.library.register_fake("dpfast::split_contiguous")
    def _(xs: list[Tensor], dim: int, sizes: list[int]) -> list[Tensor]:
        dims = checks.check_split("split_contiguous", xs, dim, sizes)
        return [x.new_empty(shape) for x, d in zip(xs, dims) for shape in _chunk_shapes(x, d, sizes)]

    @torch.library.register_fake("dpfast::scatter")
    def _(xs: list[Tensor], dim: int, sizes: list[int], devices: list[torch.device]) -> list[Tensor]:
        checks.check_scatter(sizes, devices)
        dims = checks.check_split("scatter", xs, dim, sizes)
        checks.check_meta_copy("scatter", "tensors", xs, devices)
        return [
            x.new_empty(shape, device=dev)
            for x, d in zip(xs, dims)
            for shape, dev in zip(_chunk_shapes(x, d, sizes), devices)
        ]

    @torch.library.register_fake("dpfast::gather")
    def _(chunks: list[Tensor], dim: int, device: torch.device) -> Tensor:
        _, shape = checks.check_gather(chunks, dim)
        checks.check_meta_copy("gather", "chunks", chunks, [device])
        return chunks[0].new_empty(shape, device=device)

else:
    transpose01 = reference.transpose01
    split_contiguous = reference.split_contiguous
    scatter = reference.scatter
    gather = reference.gather


def state_to_batch_first(state: State) -> State:
    """RNN state ``(L*D, B, H)``, or an ``(h, c)`` tuple of them, to ``(B, L*D, H)`` in one launch."""
    return reference._map_state(state, "state_to_batch_first", transpose01)


def state_to_layer_first(state: State) -> State:
    """RNN state ``(B, L*D, H)``, or an ``(h, c)`` tuple of them, to ``(L*D, B, H)`` in one launch."""
    return reference._map_state(state, "state_to_layer_first", transpose01)
