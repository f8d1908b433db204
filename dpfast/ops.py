"""The fused data-movement ops: thin typed wrappers over ``torch.ops.dpfast.*``, plus their fake kernels.

Kernels (CPU and CUDA) and autograd live in C++ (``csrc/``) so that a call costs one dispatcher round trip.
The fake kernels here let the ops run under ``torch.compile(fullgraph=True)``. Without the compiled extension
every function falls back to :mod:`dpfast.reference`, which gives the same results.

Result layout: ``split_contiguous`` and ``scatter`` return ``out[i][j]``, chunk ``j`` of ``tensors[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import reference
from .ext import op_checks as checks
from .ext.loader import LOADED
from .ext.op_checks import DeviceLike
from .reference import RNNState

# fmt: off
__all__ = ["transpose01", "state_to_batch_first", "state_to_layer_first", "split_contiguous", "scatter", "gather"]
# fmt: on


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
        """Each input as ``x.transpose(0, 1).contiguous()``, all of them in one kernel launch (an LSTM's h and c
        together). Bit-identical to :func:`dpfast.reference.transpose01`.

        Differentiable (the backward transposes the gradients back, in one launch too), and traceable by
        ``torch.compile(fullgraph=True)``.

        Args:
            *tensors: tensors of 2 or more dims, all on one device (CPU or CUDA); any dtype, any strides.

        Returns:
            One fresh contiguous tensor per input (never the input itself, nor a view of it), dims 0 and 1
            swapped; ``()`` for no input.

        Raises:
            TypeError: an argument is not a Tensor.
            ValueError: a tensor has fewer than 2 dims, or the tensors are on different devices.
        """
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
        """The chunks of each tensor along ``dim``, each contiguous, all tensors and chunks in one kernel launch.
        Bit-identical to :func:`dpfast.reference.split_contiguous`; differentiable.

        Args:
            tensors: the tensors to split, all on one device (their dtypes and ranks may differ).
            dim: the axis to split; a negative ``dim`` counts from the end of each tensor.
            sizes: the chunk sizes (ints >= 0, zeros allowed), summing to every tensor's size along ``dim``.

        Returns:
            ``out[i][j]``: chunk ``j`` (``sizes[j]`` long along ``dim``) of ``tensors[i]``, a fresh contiguous
            tensor.

        Raises:
            TypeError: ``dim`` or a size is not an int (a bool, a float), ``sizes`` is not an iterable of ints, or
                an element of ``tensors`` is not a Tensor.
            IndexError: ``dim`` is out of range for one of the tensors.
            ValueError: a size is negative, the sizes do not sum to a tensor's size along ``dim``, a tensor is
                0-dim, or the tensors are on different devices.
        """
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
        """The chunks of each tensor along ``dim``, chunk ``j`` on ``devices[j]``. Bit-identical to
        :func:`dpfast.reference.scatter`.

        Chunks are packed on the source device in one launch, then copied asynchronously to their devices (one
        side stream per destination GPU), ordered against the current streams of both; the host does not wait,
        except for chunks bound for the CPU. Backward gathers the gradients onto the source.

        Args:
            tensors: the tensors to split, all on one device.
            dim: the axis to split; a negative ``dim`` counts from the end of each tensor.
            sizes: one chunk size per device (ints >= 0), summing to every tensor's size along ``dim``.
            devices: one destination per chunk: ``torch.device``, ``"cuda:1"``, ``"cpu"``, or an int (a CUDA
                index); repeats allowed.

        Returns:
            ``out[i][j]``: chunk ``j`` of ``tensors[i]``, a fresh contiguous tensor on ``devices[j]``.

        Raises:
            TypeError: as :func:`split_contiguous`, or a device is not an int, str or ``torch.device``.
            IndexError: ``dim`` is out of range for one of the tensors.
            ValueError: as :func:`split_contiguous`, or ``sizes`` and ``devices`` differ in length.
            NotImplementedError: a meta tensor would be copied to a real device (it holds no data).
            RuntimeError: torch cannot use a device (an unknown device string, a CUDA device that is not there).
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
        """Concatenate ``chunks`` along ``dim`` on ``device``: the inverse of :func:`scatter` (its backward
        scatters the gradient back to the chunks' devices). Bit-identical to :func:`dpfast.reference.gather`.

        Args:
            chunks: one or more tensors of one dtype and rank, equal in every dim but ``dim``, on any devices.
            dim: the axis to concatenate; a negative ``dim`` counts from the end.
            device: where the result goes: ``torch.device``, ``"cuda:1"``, ``"cpu"``, or an int (a CUDA index).

        Returns:
            A fresh contiguous tensor on ``device``, the chunks in order along ``dim``.

        Raises:
            TypeError: ``dim`` is not an int, ``device`` is not a device, or a chunk is not a Tensor.
            IndexError: ``dim`` is out of range for a chunk.
            ValueError: ``chunks`` is empty, a chunk is 0-dim, or the chunks differ in dtype, rank, or a dim
                other than ``dim``.
            NotImplementedError: a meta chunk would be copied to a real device (it holds no data).
            RuntimeError: torch cannot use ``device`` (an unknown device string, a CUDA device that is not there).
        """
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

    # a call's per-leaf work in one call each (csrc/python_many.cpp); None where an older build lacks them
    _fast_gather_many = getattr(_C, "_gather_many", None)
    _fast_narrow_many = getattr(_C, "_narrow_many", None)

    def _gather_many(
        columns: Sequence[Sequence[Tensor]], dims: Sequence[int], device: torch.device, sizes: Sequence[int]
    ) -> tuple[list[Tensor | None], list[bool], bool] | None:
        """:func:`gather` of many leaves in one call: leaf ``i``'s chunks are ``columns[r][i]`` (replica ``r``'s
        output leaves). ``(outs, follows, all_done)``: ``outs[i]`` leaf ``i`` gathered along ``dims[i]`` onto
        ``device``, or None where its chunks are not plain dense tensors that fit together (the caller gathers it
        itself); ``follows[i]``: whether its chunks are ``sizes`` long along that dim; ``all_done``: every leaf
        gathered, every one following. None when nothing can go this way (a ``__torch_function__`` mode,
        ``torch.compile`` tracing)."""
        if _fast_gather_many is None or _compiling():
            return None
        out = _fast_gather_many(columns, dims, device, sizes)
        return None if out is NotImplemented else out

    def _narrow_many(tensors: Sequence[Tensor], axes: Sequence[int], start: int, length: int) -> list[Tensor] | None:
        """Each tensor cut to rows ``start:start+length`` along ``axes[i]`` (a view along axis 0, else a contiguous
        copy), or passed as it is where ``axes[i]`` is -1; None when the caller must narrow each itself (a cut
        tensor that is not a plain dense one, rows outside a tensor, a ``__torch_function__`` mode,
        ``torch.compile``)."""
        if _fast_narrow_many is None or _compiling():
            return None
        out = _fast_narrow_many(tensors, axes, start, length)
        return None if out is NotImplemented else out

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

    def _gather_many(
        columns: Sequence[Sequence[Tensor]], dims: Sequence[int], device: torch.device, sizes: Sequence[int]
    ) -> tuple[list[Tensor | None], list[bool], bool] | None:
        return None  # without the extension every leaf goes through gather

    def _narrow_many(tensors: Sequence[Tensor], axes: Sequence[int], start: int, length: int) -> list[Tensor] | None:
        return None  # without the extension each tensor is narrowed in Python


def state_to_batch_first(state: RNNState) -> RNNState:
    """An RNN state from torch's layout ``(L*D, B, H)`` to batch-first ``(B, L*D, H)``, h and c in one launch
    (:func:`transpose01`), so that a ``dim=0`` split of ``DataParallel`` splits it by sample. Bit-identical to
    :func:`dpfast.reference.state_to_batch_first`; differentiable.

    Args:
        state: a GRU/RNN state tensor, or an LSTM's ``(h, c)`` (any non-empty tuple or list of tensors).

    Returns:
        The same structure (a Tensor, a tuple, a list) of fresh tensors with dims 0 and 1 swapped.

    Raises:
        TypeError: ``state`` is neither a Tensor nor a non-empty tuple/list of Tensors.
        ValueError: a tensor has fewer than 2 dims, or the tensors are on different devices.
    """
    return reference._map_state(state, "state_to_batch_first", transpose01)


def state_to_layer_first(state: RNNState) -> RNNState:
    """A batch-first RNN state ``(B, L*D, H)`` back to torch's layout ``(L*D, B, H)``, h and c in one launch:
    what ``torch.nn.LSTM``/``GRU``/``RNN`` take as ``hx``. The inverse of :func:`state_to_batch_first`;
    bit-identical to :func:`dpfast.reference.state_to_layer_first`; differentiable.

    Args:
        state: a batch-first state, as :func:`state_to_batch_first` takes torch's.

    Returns:
        The same structure with dims 0 and 1 swapped in every tensor, as :func:`state_to_batch_first` returns it.

    Raises:
        TypeError, ValueError: as :func:`state_to_batch_first` raises them.
    """
    return reference._map_state(state, "state_to_layer_first", transpose01)
