"""The fused data-movement ops: thin typed wrappers over ``torch.ops.dpfast.*``, plus their fake kernels.

Kernels (CPU and CUDA) and autograd live in C++ (``csrc/``) so that a call costs one dispatcher round trip.
The fake kernels here let the ops run under ``torch.compile(fullgraph=True)``. Without the compiled extension
every function falls back to :mod:`dpfast.reference`, which gives the same results.

Result layout: ``split_contiguous`` and ``scatter`` return ``out[i][j]``, chunk ``j`` of ``tensors[i]``.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from . import reference
from ._extension import LOADED

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


_DEVICE_CACHE: dict = {}
_CPU = torch.device("cpu")


def as_device(d: DeviceLike) -> torch.device:
    """``0`` -> ``cuda:0``; strings and devices as torch reads them; a bare ``"cuda"`` -> the current CUDA device."""
    # the common case, already normal (compared with ==: reading torch.device.type builds a string, ~0.4 µs)
    if type(d) is torch.device and (d.index is not None or d == _CPU):
        return d
    if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
        raise TypeError(f"expected a device (int, str or torch.device), got {type(d).__name__} {d!r}")
    key = (type(d), d)
    dev = _DEVICE_CACHE.get(key)
    if dev is None:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if dev.type == "cuda" and dev.index is None:
            # "cuda" means the current device, which can change: never cached
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else dev
        if len(_DEVICE_CACHE) < 256:  # parsing a device string costs microseconds; calls repeat the same few
            _DEVICE_CACHE[key] = dev
    return dev


def _unflatten(flat: Sequence[Tensor], n_tensors: int, n_chunks: int) -> list[list[Tensor]]:
    return [list(flat[i * n_chunks : (i + 1) * n_chunks]) for i in range(n_tensors)]


if LOADED:
    from ._extension import C as _C

    _transpose01 = torch.ops.dpfast.transpose01.default
    _split = torch.ops.dpfast.split_contiguous.default
    _scatter = torch.ops.dpfast.scatter.default
    _gather = torch.ops.dpfast.gather.default
    # Direct entry points (csrc/python_calls.cpp): about 2 µs a call cheaper than torch.ops' boxed path. They take
    # plain tensors and arguments and return NotImplemented for anything else (a subclass, a __torch_function__
    # mode), which then goes through torch.ops. torch.compile traces the torch.ops path.
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
        return tuple(_transpose01(tensors)) if tensors else ()

    def split_contiguous(tensors: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> list[list[Tensor]]:
        """``out[i][j]``: chunk ``j`` (``sizes[j]`` long along ``dim``) of ``tensors[i]``, contiguous; one launch."""
        if not _compiling():
            out = _fast_split(tensors, dim, sizes)
            if out is not NotImplemented:
                return out
        sizes = list(sizes)
        if not tensors:
            return reference.split_contiguous(tensors, dim, sizes)
        return _unflatten(_split(tensors, dim, sizes), len(tensors), len(sizes))

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
        sizes = list(sizes)
        if not tensors:
            return reference.scatter(tensors, dim, sizes, devices)
        return _unflatten(_scatter(tensors, dim, sizes, devices), len(tensors), len(sizes))

    def gather(chunks: Sequence[Tensor], dim: int, device: DeviceLike) -> Tensor:
        """Concatenate ``chunks`` along ``dim`` on ``device`` (the inverse of :func:`scatter`)."""
        device = as_device(device)
        if not _compiling():
            out = _fast_gather(chunks, dim, device)
            if out is not NotImplemented:
                return out
        if not chunks:
            return reference.gather(chunks, dim, device)  # raises the error that names the problem
        return _gather(chunks, dim, device)

    # ---- fake kernels: shapes, dtypes and devices only, for torch.compile / FakeTensor tracing ----

    def _fake_dim(t: Tensor, dim: int) -> int:
        torch._check(-t.dim() <= dim < t.dim(), lambda: f"dim {dim} out of range for shape {tuple(t.shape)}")
        return dim % t.dim()

    @torch.library.register_fake("dpfast::transpose01")
    def _(xs: list[Tensor]) -> list[Tensor]:
        outs = []
        for x in xs:
            torch._check(x.dim() >= 2, lambda: "transpose01: every tensor needs at least 2 dims")
            shape = list(x.shape)
            shape[0], shape[1] = shape[1], shape[0]
            outs.append(x.new_empty(shape))
        return outs

    @torch.library.register_fake("dpfast::split_contiguous")
    def _(xs: list[Tensor], dim: int, sizes: list[int]) -> list[Tensor]:
        outs = []
        for x in xs:
            d = _fake_dim(x, dim)
            torch._check(sum(sizes) == x.shape[d], lambda: "split_contiguous: sizes must sum to the axis")
            for s in sizes:
                shape = list(x.shape)
                shape[d] = s
                outs.append(x.new_empty(shape))
        return outs

    @torch.library.register_fake("dpfast::scatter")
    def _(xs: list[Tensor], dim: int, sizes: list[int], devices: list[torch.device]) -> list[Tensor]:
        torch._check(len(sizes) == len(devices), lambda: "scatter: one device per chunk size")
        outs = []
        for x in xs:
            d = _fake_dim(x, dim)
            torch._check(sum(sizes) == x.shape[d], lambda: "scatter: sizes must sum to the axis")
            for s, dev in zip(sizes, devices):
                shape = list(x.shape)
                shape[d] = s
                outs.append(x.new_empty(shape, device=dev))
        return outs

    @torch.library.register_fake("dpfast::gather")
    def _(chunks: list[Tensor], dim: int, device: torch.device) -> Tensor:
        torch._check(len(chunks) > 0, lambda: "gather: chunks is empty")
        d = _fake_dim(chunks[0], dim)
        shape = list(chunks[0].shape)
        shape[d] = sum(c.shape[d] for c in chunks)
        return chunks[0].new_empty(shape, device=device)

else:
    transpose01 = reference.transpose01
    split_contiguous = reference.split_contiguous
    gather = reference.gather

    def scatter(  # type: ignore[misc]
        tensors: Sequence[Tensor], dim: int, sizes: Sequence[int], devices: Sequence[DeviceLike]
    ) -> list[list[Tensor]]:
        return reference.scatter(tensors, dim, sizes, [as_device(d) for d in devices])


def state_to_batch_first(state: State) -> State:
    """RNN state ``(L*D, B, H)``, or an ``(h, c)`` tuple of them, to ``(B, L*D, H)`` in one launch."""
    return reference._map_state(state, "state_to_batch_first", transpose01)


def state_to_layer_first(state: State) -> State:
    """RNN state ``(B, L*D, H)``, or an ``(h, c)`` tuple of them, to ``(L*D, B, H)`` in one launch."""
    return reference._map_state(state, "state_to_layer_first", transpose01)
