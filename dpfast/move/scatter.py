"""Scatter whole argument trees to the replicas through :mod:`dpfast.ops` (the way out is :mod:`dpfast.move.gather`).

All tensors that share a source device, a batch axis and a memory format move in one ``ops.scatter`` call (one
pack, one copy per device; the call's program groups them), so an LSTM state ``(h, c)`` costs one call, not two.
Everything is differentiable: gradients of the chunks flow back to the caller's tensors.

Memory format: a ``channels_last`` (or ``channels_last_3d``) tensor is an NHWC tensor in memory, so it is scattered
as its contiguous NHWC view and every chunk is viewed back as NCHW: chunks in the caller's format, at no extra copy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .. import ops
from ..trees.binding import BoundArguments
from ..trees.facts import inverse
from ..trees.flatten import flatten, unflatten
from .nested import scatter_jagged


def move(v: Any, device: torch.device) -> Any:
    if isinstance(v, (Tensor, PackedSequence)) and v.data.device != device:
        return v.to(device)
    return v


def move_all(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside it on ``device`` (a leaf, or a sequence under ``"items"``)."""
    if isinstance(value, (Tensor, PackedSequence)) or value is None:
        return move(value, device)
    leaves, tdef = flatten(value)
    return unflatten(tdef, [move(v, device) for v in leaves])


def move_item(value: Any, device: torch.device) -> Any:
    """A per-sample item on ``device``: its tensors, and any object in it with a ``.to`` method (a PyG ``Data``),
    moved as PyG's own DataParallel moves its batches; ``.to`` is called on a shallow copy, so the caller's object
    stays where it is (PyG's ``Data.to`` moves in place)."""
    leaves, tdef = flatten(value)
    return unflatten(tdef, [_to(v, device) for v in leaves])


def _to(v: Any, device: torch.device) -> Any:
    to = getattr(v, "to", None)
    if isinstance(v, (Tensor, PackedSequence, nn.Module, type)) or v is None or not callable(to):
        return move(v, device)
    with contextlib.suppress(Exception):  # an object that cannot be copied is moved as it is
        v = copy.copy(v)
    moved = v.to(device)
    return v if moved is None else moved


def move_tree(tree: BoundArguments, device: torch.device) -> tuple[tuple, dict]:
    """The call's arguments, whole, with every tensor on ``device`` (the one-call paths)."""
    return tree.rebuild([move_all(v, device) for v in tree.flat])


def scatter_tree(
    tree: BoundArguments, sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` per replica, by the call's program: the leaves it splits, split by ``sizes`` onto
    ``devices``; other tensors copied to each distinct device once (the original where it already is), everything
    else by reference."""
    program, flat = tree.program, tree.flat
    if program.all_one_group:  # every leaf a tensor on the CPU to split one way (a call like model(x, h))
        (((axis, _, _), _),) = program.groups
        return [tree.rebuild(row, own_caches=True) for row in zip(*ops.scatter(flat, axis, sizes, devices))]
    per_replica = [list(flat) for _ in devices]  # everything else reaches every replica by reference
    for (axis, perm, kind), where in program.groups:
        for idx in _by_device(flat, where, kind):
            for i, chunks in zip(idx, _scatter_group([flat[i] for i in idx], axis, perm, sizes, devices)):
                for row, chunk in zip(per_replica, chunks):
                    row[i] = chunk
    for i in program.copied:
        for row, moved in zip(per_replica, _replicated(flat[i], devices)):
            row[i] = moved
    for i, how, axis in program.special:
        v = flat[i]
        if how == "items":
            parts = split_items(v, sizes, devices)
        elif how == "packed":
            parts = scatter_packed(v, sizes, devices)
        elif how == "jagged":
            parts = scatter_jagged(v, sizes, devices)
        else:  # quantized
            parts = split_quantized(v, axis, sizes, devices)
        for row, part in zip(per_replica, parts):
            row[i] = part
    # each replica gets KV caches of its own: a model updates its cache in place
    return [tree.rebuild(row, own_caches=True) for row in per_replica]


def _by_device(flat: list, where: list[int], kind: str) -> list[list[int]]:
    """A group's tensors by the device they are on (one ``ops.scatter`` call each): CUDA tensors may be on several."""
    if kind != "cuda":
        return [where]
    by: dict[torch.device, list[int]] = {}
    for i in where:
        by.setdefault(flat[i].device, []).append(i)
    return list(by.values())


def _scatter_group(
    tensors: list[Tensor], axis: int, perm: tuple | None, sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[list[Tensor]]:
    """``ops.scatter`` of tensors on one device; channels_last ones as their NHWC views, each chunk viewed back."""
    if perm is None:
        return ops.scatter(tensors, axis, sizes, devices)
    back = inverse(perm)
    chunks = ops.scatter([t.permute(perm) for t in tensors], perm.index(axis), sizes, devices)
    return [[c.permute(back) for c in row] for row in chunks]


def _replicated(v: Any, devices: Sequence[torch.device]) -> list:
    """``v`` for each of ``devices``: copied once per distinct device (the original where it already is)."""
    moved = {d: move(v, d) for d in dict.fromkeys(devices)}
    return [moved[d] for d in devices]


def split_quantized(q: Tensor, axis: int, sizes: Sequence[int], devices: Sequence[torch.device]) -> list[Tensor]:
    """Chunks of a quantized tensor along ``axis``, each a contiguous copy on its device. torch narrows them (the
    fused ops move plain dtypes; torch keeps a chunk's scale and zero point, and slices per-channel ones)."""
    out, start = [], 0
    for size, device in zip(sizes, devices):
        out.append(q.narrow(axis, start, size).clone(memory_format=torch.contiguous_format).to(device))
        start += size
    return out


def split_items(seq: Sequence, sizes: Sequence[int], devices: Sequence[torch.device]) -> list:
    """Contiguous sub-sequences of ``seq`` (same type) with the given lengths, each item moved to its device."""
    out, start = [], 0
    for size, device in zip(sizes, devices):
        part = [move_item(item, device) for item in seq[start : start + size]]
        out.append(part if type(seq) is list else tuple(part) if type(seq) is tuple else type(seq)(part))
        start += size
    return out


def scatter_packed(ps: PackedSequence, sizes: Sequence[int], devices: Sequence[torch.device]) -> list:
    """Split a PackedSequence by sequence, in the caller's batch order, and re-pack each chunk on its device."""
    padded, lengths = pad_packed_sequence(ps)  # (T, B, *), lengths in the caller's order (CPU)
    chunks = ops.scatter([padded], 1, sizes, devices)[0]
    out = []
    for chunk, lens in zip(chunks, torch.split(lengths, list(sizes))):
        out.append(pack_padded_sequence(chunk[: int(lens.max())], lens, enforce_sorted=False))
    return out
