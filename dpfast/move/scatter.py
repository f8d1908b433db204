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
from ..trees.binding import BoundArguments
from ..trees.flatten import flatten, unflatten
from ..trees.specs import Leaf
from .nested import scatter_jagged

_LAST = {4: (torch.channels_last, (0, 2, 3, 1)), 5: (torch.channels_last_3d, (0, 2, 3, 4, 1))}


def memory_order(t: Tensor) -> tuple[int, ...] | None:
    """The permutation that views a channels_last (3d) tensor as the contiguous tensor it is in memory (NCHW ->
    NHWC), or None for any other tensor (those move as contiguous chunks)."""
    last = _LAST.get(t.dim())
    if last is None or t.is_nested or not t.is_contiguous(memory_format=last[0]):
        return None
    if t.is_contiguous() and not _strides_like_channels_last(t):  # both formats: the strides decide, as for torch
        return None
    return last[1]


def _strides_like_channels_last(t: Tensor) -> bool:
    """torch's own tie-break for a tensor contiguous in both formats (a chunk of one channel, of 1x1 pixels):
    c10's ``is_channels_last_strides_2d/3d``, which ``torch.cat`` and ``empty_like`` follow. Strides must grow
    through C, W, (D,) H, N, and N's may not equal C's (an N111 tensor is NCHW)."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, *range(t.dim() - 1, 1, -1), 0):
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


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


def move_tree(tree: BoundArguments, device: torch.device) -> tuple[tuple, dict]:
    """The call's arguments, whole, with every tensor on ``device`` (the one-call paths)."""
    return tree.rebuild([move_all(leaf.value, device) for leaf in tree.leaves])


def scatter_tree(
    tree: BoundArguments, sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` per replica: the leaves planning marked as split, split by ``sizes`` onto ``devices``;
    other tensors copied to each distinct device once (the original where it already is), everything else by
    reference."""
    if tree.split is not None:
        return _scatter_flat(tree, sizes, devices)
    n = len(devices)
    per_leaf: list[list] = [None] * len(tree.leaves)  # type: ignore[list-item]
    groups: dict[tuple[torch.device, int, tuple | None], list[Leaf]] = {}
    for leaf in tree.leaves:
        v, how = leaf.value, leaf.split
        if how == "tensor":
            groups.setdefault((v.device, leaf.axis, memory_order(v)), []).append(leaf)
        elif how is None:
            if isinstance(v, (Tensor, PackedSequence)):
                per_leaf[leaf.index] = _replicated(v, devices)
            else:
                per_leaf[leaf.index] = [v] * n
        elif how == "items":
            per_leaf[leaf.index] = split_items(v, sizes, devices)
        elif how == "packed":
            per_leaf[leaf.index] = scatter_packed(v, sizes, devices)
        elif how == "jagged":
            per_leaf[leaf.index] = scatter_jagged(v, sizes, devices)
        else:  # quantized
            per_leaf[leaf.index] = split_quantized(v, leaf.axis, sizes, devices)
    for (_, axis, perm), leaves in groups.items():
        if perm is None:
            chunks = ops.scatter([leaf.value for leaf in leaves], axis, sizes, devices)
        else:  # channels_last: scatter the NHWC view along the same axis, view each chunk back as NCHW
            back = inverse(perm)
            chunks = ops.scatter([leaf.value.permute(perm) for leaf in leaves], perm.index(axis), sizes, devices)
            chunks = [[c.permute(back) for c in row] for row in chunks]
        for leaf, row in zip(leaves, chunks):
            per_leaf[leaf.index] = row
    # each replica gets KV caches of its own: a model updates its cache in place
    return [tree.rebuild([row[j] for row in per_leaf], own_caches=True) for j in range(n)]


def _scatter_flat(
    tree: BoundArguments, sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[tuple[tuple, dict]]:
    """:func:`scatter_tree` of a call planned along a skeleton (its tensors plain, those to split on one device,
    none channels_last): the same moves, from the flat leaves, without a record per leaf."""
    assert tree.skeleton is not None and tree.flat is not None and tree.split is not None
    flat, tensors, (axes, _) = tree.flat, tree.skeleton.tensors, tree.split
    groups: dict[int, list[int]] = {}  # axis -> positions among the leaves, in order
    whole: list[int] = []
    for i, axis in zip(tensors, axes):
        if axis >= 0:
            groups.setdefault(axis, []).append(i)
        else:
            whole.append(i)
    if len(groups) == 1 and not whole and len(tensors) == len(flat):  # every leaf a tensor to split one way
        ((axis, _),) = groups.items()
        chunks = ops.scatter(flat, axis, sizes, devices)
        return [tree.rebuild(row, own_caches=True) for row in zip(*chunks)]
    per_replica = [list(flat) for _ in devices]  # everything else reaches every replica by reference
    for i in whole:
        for row, moved in zip(per_replica, _replicated(flat[i], devices)):
            row[i] = moved
    for axis, idx in groups.items():
        for i, chunks in zip(idx, ops.scatter([flat[i] for i in idx], axis, sizes, devices)):
            for row, chunk in zip(per_replica, chunks):
                row[i] = chunk
    return [tree.rebuild(row, own_caches=True) for row in per_replica]


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
