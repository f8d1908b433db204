"""Readings of ``B`` for a call whose mapped leaves disagree on it, where the size most arguments agree on would
replicate a whole tensor argument: which size is the batch, and where each leaf has it. Only an error reads them.

A *reading* of a size ``S`` gives each mapped leaf its own axis when that has size ``S``, else axis 0, else (for a
tensor of 3 dims or more: a sequence-first input, an RNN state) axis 1; a leaf with none is replicated (``None``).
The reading that splits the most leaves is picked when it alone does and keeps one on its own axis, or when of
several it alone keeps the first argument on its own axis (as torch's ``dim=0`` does); otherwise every reading that
could be meant is listed, and the user says which. A sequence-first ``MultiheadAttention`` (query ``(L, N, E)``,
key ``(S, N, E)``) reads as ``B = N`` with every tensor on axis 1, or as ``B = S`` with the query replicated: both
are listed (with a ``key_padding_mask`` of ``(N, S)``, ``B = N`` is picked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import Tensor

from ..trees.specs import Leaf, Spec


@dataclasses.dataclass
class Reading:
    """``batch``, and per mapped leaf (by index) the spec that puts its batch axis there (None: replicated)."""

    batch: int
    specs: dict[int, Spec]
    split: int  # mapped leaves split
    kept: int  # of those, the ones that stay on their own axes
    keeps_first: bool  # the first argument with a mapped leaf is split, on its own axes


def _spec_for(leaf: Leaf, size: int) -> Spec:
    """The spec that gives ``leaf`` its batch axis where it has ``size``: its own spec when its own axis has it,
    else axis 0, then (for 3 dims or more: a sequence-first input, an RNN state) axis 1; else None (replicated).
    (A matrix's axis 1 is its features far more often than its batch.)"""
    v = leaf.value
    if leaf.size == size and leaf.problem is None:
        return leaf.spec
    if leaf.is_items or leaf.is_packed or not isinstance(v, Tensor) or v.dim() == 0:
        return None  # (items and sequences are split by position: their size is what it is)
    if v.is_nested:
        return 0 if v.size(0) == size else None
    return next((ax for ax in _batch_axes(v) if v.shape[ax] == size), None)


def _batch_axes(v: Tensor) -> tuple[int, ...]:
    """Where a tensor's batch may be: axis 0, and for 3 dims or more axis 1."""
    return (0, 1) if v.dim() >= 3 else (0,) if v.dim() else ()


def _candidates(mapped: Sequence[Leaf]) -> list[int]:
    sizes: list[int] = []
    for leaf in mapped:
        v = leaf.value
        found = [leaf.size] if leaf.size is not None else []
        if isinstance(v, Tensor) and not v.is_nested and not (leaf.is_items or leaf.is_packed):
            found += [v.shape[ax] for ax in _batch_axes(v)]
        sizes += [s for s in dict.fromkeys(found) if s > 0 and s not in sizes]
    return sizes


def readings(mapped: Sequence[Leaf]) -> list[Reading]:
    """Every reading of the sizes the mapped leaves have on their own axes and on axes 0 and 1."""
    out = []
    for size in _candidates(mapped):
        specs = {leaf.index: _spec_for(leaf, size) for leaf in mapped}
        split = [leaf for leaf in mapped if specs[leaf.index] is not None]
        kept = [leaf for leaf in split if specs[leaf.index] == leaf.spec]
        first = min(leaf.arg for leaf in mapped)
        keeps_first = any(x.arg == first for x in split) and all(x.arg != first for x in split if x not in kept)
        out.append(Reading(size, specs, len(split), len(kept), keeps_first))
    return out


def pick(found: Sequence[Reading], vote: int | None) -> tuple[Reading | None, list[Reading]]:
    """``(the reading to suggest, [])``, or ``(None, the readings to list)`` when more than one could be meant."""
    if not found:
        return None, []
    best = max(r.split for r in found)
    top = [r for r in found if r.split == best]
    if len(top) == 1 and top[0].kept > 0:
        return top[0], []
    keeping_first = [r for r in top if r.keeps_first]
    if len(top) > 1 and len(keeping_first) == 1:  # the first argument's own axis decides a tie (as torch's dim 0)
        return keeping_first[0], []
    if len(top) == 1:  # it moves every argument: the reading that keeps the most is as likely
        others = [r for r in found if r is not top[0]]
        most = max((r.kept for r in others), default=0)
        keeping = [r for r in others if r.kept == most and most > 0]
        top += [r for r in keeping if r.batch == vote] or keeping
    top.sort(key=lambda r: (-r.split, -r.kept, r.batch != vote))
    return (top[0], []) if len(top) == 1 else (None, top)
