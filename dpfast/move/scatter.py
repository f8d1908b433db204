"""Scatter whole argument trees to the replicas through :mod:`dpfast.ops` (the way out is :mod:`dpfast.move.gather`).

All tensors that share a source device, a batch axis and a memory format move in one ``ops.scatter`` call (one
pack, one copy per device), so an LSTM state ``(h, c)`` costs one call, not two. Everything is differentiable:
gradients of the chunks flow back to the caller's tensors.

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
from ..plan.call_plan import Mapped
from ..trees.binding import ArgumentTree
from ..trees.flatten import flatten, unflatten
from .nested import scatter_jagged

_LAST = {4: (torch.channels_last, (0, 2, 3, 1)), 5: (torch.channels_last_3d, (0, 2, 3, 4, 1))}


def memory_order(t: Tensor) -> tuple[int, ...] | None:
    """The permutation that views a channels_last (3d) tensor as the contiguous tensor it is in memory (NCHW ->
    NHWC), or None for any other tensor (those move as contiguous chunks)."""
    last = _LAST.get(t.dim())
    if last is None or t.is_nested or t.is_contiguous() or not t.is_contiguous(memory_format=last[0]):
        return None
    return last[1]


def inverse(perm: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(range(len(perm)), key=lambda i: perm[i]))


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


def move_tree(tree: ArgumentTree, device: torch.device) -> tuple[tuple, dict]:
    """The call's arguments, whole, with every tensor on ``device`` (the one-call paths)."""
    return tree.rebuild([move_all(leaf.value, device) for leaf in tree.leaves])


def scatter_tree(
    tree: ArgumentTree, mapped: Sequence[Mapped], sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` per replica: mapped leaves split by ``sizes`` onto ``devices``, other tensors copied to
    each distinct device once (the original where it already is), everything else by reference."""
    n = len(devices)
    index = {id(leaf): k for k, leaf in enumerate(tree.leaves)}
    per_leaf: list[list | None] = [None] * len(tree.leaves)

    groups: dict[tuple[torch.device, int, tuple | None], list[Mapped]] = {}
    for m in mapped:
        v = m.leaf.value
        if m.is_items:
            per_leaf[index[id(m.leaf)]] = split_items(v, sizes, devices)
        elif m.is_packed:
            per_leaf[index[id(m.leaf)]] = scatter_packed(v, sizes, devices)
        elif v.is_nested:
            per_leaf[index[id(m.leaf)]] = scatter_jagged(v, sizes, devices)
        else:
            groups.setdefault((v.device, m.axis, memory_order(v)), []).append(m)
    for (_, axis, perm), ms in groups.items():
        if perm is None:
            chunks = ops.scatter([m.leaf.value for m in ms], axis, sizes, devices)
        else:  # channels_last: scatter the NHWC view along the same axis, view each chunk back as NCHW
            back = inverse(perm)
            chunks = ops.scatter([m.leaf.value.permute(perm) for m in ms], perm.index(axis), sizes, devices)
            chunks = [[c.permute(back) for c in row] for row in chunks]
        for m, row in zip(ms, chunks):
            per_leaf[index[id(m.leaf)]] = row

    copies: dict[tuple[int, torch.device], Any] = {}
    for k, leaf in enumerate(tree.leaves):
        if per_leaf[k] is not None:
            continue
        v = leaf.value
        if isinstance(v, (Tensor, PackedSequence)):
            row = []
            for d in devices:
                key = (k, d)
                if key not in copies:
                    copies[key] = move(v, d)
                row.append(copies[key])
            per_leaf[k] = row
        else:
            per_leaf[k] = [v] * n
    # each replica gets KV caches of its own: a model updates its cache in place
    return [tree.rebuild([row[j] for row in per_leaf], own_caches=True) for j in range(n)]  # type: ignore[index]


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
