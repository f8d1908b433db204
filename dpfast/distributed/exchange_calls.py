"""The output exchange's per-tensor work in one extension call each (``csrc/python_exchange.cpp``): one rank's
bytes to send, every rank's header, and every tensor's part of the gathered bytes. Each returns None where the
caller must do it in Python: anything the extension cannot place (checked there before anything is made), a
``__torch_function__`` mode (which must see every op), ``torch.compile``, or a build without the extension."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..ext.loader import LOADED, C

_pack = getattr(C, "_pack_payload", None) if LOADED else None
_int_rows = getattr(C, "_int_rows", None) if LOADED else None
_blocks = getattr(C, "_blocks", None) if LOADED else None
_compiling = torch.compiler.is_compiling


def _called(entry: Any, *args: Any) -> Any:
    """``entry(*args)``, or None where it is missing, declines (NotImplemented) or must not run (compiling)."""
    if entry is None or _compiling():
        return None
    out = entry(*args)
    return None if out is NotImplemented else out


def pack_payload(
    size: int,
    device: torch.device,
    ints: Sequence[int],
    tensors: Sequence[Tensor],
    axes: Sequence[int],
    offsets: Sequence[int],
    base: int,
) -> Tensor | None:
    """``size`` zeroed bytes on ``device`` holding ``ints`` (int64) from byte 0 and each tensor's bytes at
    ``base + offsets[i]``, its axis ``axes[i]`` moved to the front (a 0-dim one as one row)."""
    return _called(_pack, size, device, ints, tensors, axes, offsets, base)


def int_rows(gathered: Tensor, count: int) -> list[list[int]] | None:
    """The first ``count`` int64 of each row of the ``(world, width)`` bytes ``gathered``, as lists (what
    ``gathered[:, :8 * count].view(torch.int64).tolist()`` gives)."""
    return _called(_int_rows, gathered, count)


def blocks(
    gathered: Tensor,
    base: int,
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[tuple],
    offsets: Sequence[int],
    rows: Sequence[bool],
) -> list[Tensor] | None:
    """Each tensor's part of every row of the bytes ``gathered`` (every row placed alike): ``shapes[i]`` of
    ``dtypes[i]`` at byte ``base + offsets[i]``; with ``rows[i]`` every row's one after the other (a view with one
    row, else a copy), else stacked ``(world, *shape)``."""
    return _called(_blocks, gathered, base, dtypes, shapes, offsets, rows)
