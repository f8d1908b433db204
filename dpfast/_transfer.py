"""Scatter whole argument trees to the replicas through :mod:`dpfast.ops` (the way out is :mod:`dpfast._gather`).

All tensors that share a source device and a batch axis move in one ``ops.scatter`` call (one pack, one copy per
device), so an LSTM state ``(h, c)`` costs one call, not two. Everything is differentiable: gradients of the
chunks flow back to the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import ops
from ._binding import ArgumentTree
from ._planning import Mapped


def move(v: Any, device: torch.device) -> Any:
    if isinstance(v, (Tensor, PackedSequence)) and v.data.device != device:
        return v.to(device)
    return v


def move_tree(tree: ArgumentTree, device: torch.device) -> tuple[tuple, dict]:
    """The call's arguments, whole, with every tensor on ``device`` (the one-call paths)."""
    return tree.rebuild([move(leaf.value, device) for leaf in tree.leaves])


def scatter_tree(
    tree: ArgumentTree, mapped: Sequence[Mapped], sizes: Sequence[int], devices: Sequence[torch.device]
) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` per replica: mapped leaves split by ``sizes`` onto ``devices``, other tensors copied to
    each distinct device once (the original where it already is), everything else by reference."""
    n = len(devices)
    index = {id(leaf): k for k, leaf in enumerate(tree.leaves)}
    per_leaf: list[list | None] = [None] * len(tree.leaves)

    groups: dict[tuple[torch.device, int], list[Mapped]] = {}
    for m in mapped:
        if m.is_packed:
            per_leaf[index[id(m.leaf)]] = scatter_packed(m.leaf.value, sizes, devices)
        else:
            groups.setdefault((m.leaf.value.device, m.axis), []).append(m)
    for (_, axis), ms in groups.items():
        chunks = ops.scatter([m.leaf.value for m in ms], axis, sizes, devices)
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
    return [tree.rebuild([row[j] for row in per_leaf]) for j in range(n)]  # type: ignore[index]


def scatter_packed(ps: PackedSequence, sizes: Sequence[int], devices: Sequence[torch.device]) -> list:
    """Split a PackedSequence by sequence, in the caller's batch order, and re-pack each chunk on its device."""
    padded, lengths = pad_packed_sequence(ps)  # (T, B, *), lengths in the caller's order (CPU)
    chunks = ops.scatter([padded], 1, sizes, devices)[0]
    out = []
    for chunk, lens in zip(chunks, torch.split(lengths, list(sizes))):
        out.append(pack_padded_sequence(chunk[: int(lens.max())], lens, enforce_sorted=False))
    return out
