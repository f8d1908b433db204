"""Batch size, chunk sizes, the :class:`ScatterError` with its suggested fix, and ``plan()`` rendering.

How ``B`` is chosen when the mapped tensors disagree: every top-level argument votes with the size of its first
mapped tensor along its batch axis; the size with most votes wins and ties go to the earliest argument (in call
order: positional, then keyword). So ``f(x, h)`` with ``x`` ``(B, T, F)`` and an LSTM state ``h = (h0, c0)`` of
``(L, B, H)`` under the default ``dim=0`` reads ``B`` from ``x`` and reports ``h[0]`` and ``h[1]`` as the mismatch,
with ``in_dims={'h': 1}`` as the fix.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ._binding import ArgumentSpecs, ArgumentTree
from ._specs import Spec, spec_tree_repr


class ScatterError(ValueError):
    """The inputs cannot be split into one batch: the message lists every mapped tensor and suggests a fix."""


# ---------------------------------------------------------------------------------------------------------------
# Chunk sizes
# ---------------------------------------------------------------------------------------------------------------


def validate_chunk_sizes(chunk_sizes: Sequence[float] | None, n_devices: int) -> list[Fraction] | None:
    """Relative weights per device (exact fractions), or ``None`` for an even split."""
    if chunk_sizes is None:
        return None
    if isinstance(chunk_sizes, (str, bytes)) or not hasattr(chunk_sizes, "__len__"):
        raise TypeError(
            f"chunk_sizes must be a sequence of relative weights, one per device, got {type(chunk_sizes).__name__}"
        )
    weights = list(chunk_sizes)
    if len(weights) != n_devices:
        raise ValueError(
            f"chunk_sizes has {len(weights)} weights but there are {n_devices} device_ids; give one weight per "
            "device (0 skips a device)"
        )
    out = []
    for i, w in enumerate(weights):
        # numbers.Real takes numpy's ints and floats too; bool (an int) is almost surely a mistake
        if isinstance(w, bool) or type(w).__name__ == "bool_" or not isinstance(w, numbers.Real):
            raise TypeError(f"chunk_sizes[{i}] is {type(w).__name__} {w!r}; weights are ints or floats")
        if not isinstance(w, numbers.Rational) and not math.isfinite(w):
            raise ValueError(f"chunk_sizes[{i}] is {w!r}; weights must be finite")
        if w < 0:
            raise ValueError(f"chunk_sizes[{i}] is {w!r}; weights must be >= 0 (0 skips that device)")
        out.append(Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(w))
    if sum(out) == 0:
        raise ValueError(f"chunk_sizes {weights!r} are all zero; at least one device needs a positive weight")
    return out


def split_sizes(batch: int, n: int, weights: Sequence[Fraction] | None = None) -> list[int]:
    """Per-device chunk sizes summing to ``batch``: as even as possible (earlier devices take the remainder), or
    proportional to ``weights`` by largest remainder (ties to earlier devices; weight 0 always gets 0)."""
    if batch < 0:
        raise ValueError(f"batch size must be >= 0, got {batch}")
    if weights is None:
        q, r = divmod(batch, n)
        return [q + (1 if i < r else 0) for i in range(n)]
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} devices")
    total = sum(weights)
    quotas = [Fraction(batch) * w / total for w in weights]
    sizes = [math.floor(q) for q in quotas]
    left = batch - sum(sizes)
    order = sorted((i for i in range(n) if weights[i] > 0), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    return sizes


# ---------------------------------------------------------------------------------------------------------------
# Mapped leaves and the batch size
# ---------------------------------------------------------------------------------------------------------------


def packed_batch(ps: PackedSequence) -> int:
    return int(ps.batch_sizes[0]) if ps.batch_sizes.numel() else 0


class Mapped:
    """A leaf with an int spec: a tensor to split along ``axis``, or a PackedSequence to split by sequence."""

    __slots__ = ("leaf", "arg", "axis", "size", "problem")

    def __init__(self, leaf, arg: int):
        self.leaf = leaf
        self.arg = arg
        self.axis: int | None = None
        self.size: int | None = None
        self.problem: str | None = None
        v, spec = leaf.value, leaf.spec
        if isinstance(v, PackedSequence):
            self.size = packed_batch(v)
        elif v.dim() == 0:
            self.problem = "0-dim tensor has no batch axis"
        elif not -v.dim() <= spec < v.dim():
            self.problem = f"axis {spec} out of range for {v.dim()} dims"
        else:
            self.axis = spec % v.dim()
            self.size = v.shape[self.axis]

    @property
    def is_packed(self) -> bool:
        return isinstance(self.leaf.value, PackedSequence)


def shape_text(v: Any) -> str:
    if isinstance(v, Tensor):
        return str(tuple(v.shape))
    if isinstance(v, PackedSequence):
        return f"packed(B={packed_batch(v)}, data={tuple(v.data.shape)})"
    return type(v).__name__


def mapped_leaves(tree: ArgumentTree) -> list[Mapped]:
    """The leaves to split; a non-tensor under an explicit int spec is an error (under the default it is passed
    by reference, as torch does)."""
    out = []
    for leaf, arg in zip(tree.leaves, tree.leaf_arg):
        if leaf.spec is None:
            continue
        v = leaf.value
        if isinstance(v, (Tensor, PackedSequence)):
            out.append(Mapped(leaf, arg))
        elif leaf.explicit and v is not None:
            kind = type(v).__name__
            raise TypeError(
                f"in_dims gives `{leaf.path}` the batch axis {leaf.spec}, but it is "
                f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}, not a tensor; pass it as a tensor "
                "(e.g. torch.tensor(...)) to split it, or give it the spec None to pass it unchanged to every replica"
            )
    return out


def choose_batch(mapped: Sequence[Mapped]) -> int | None:
    votes: dict[int, int] = {}
    for m in mapped:
        if m.size is not None and m.arg not in votes:
            votes[m.arg] = m.size
    if not votes:
        return None
    counts = Counter(votes.values())
    first = {}
    for arg in sorted(votes):
        first.setdefault(votes[arg], arg)
    return max(counts, key=lambda s: (counts[s], -first[s]))


def check_batch(tree: ArgumentTree, specs: ArgumentSpecs, mapped: Sequence[Mapped]) -> int | None:
    """``B``, or ``None`` when nothing is mapped; raises :class:`ScatterError` on any disagreement."""
    batch = choose_batch(mapped)
    bad = [m for m in mapped if m.problem is not None or m.size != batch]
    if not bad:
        return batch
    raise ScatterError(_scatter_message(tree, specs, mapped, bad, batch))


def _suggest_axis(m: Mapped, batch: int | None) -> Spec:
    v = m.leaf.value
    if batch is not None and isinstance(v, Tensor):
        for ax, s in enumerate(v.shape):
            if s == batch:
                return ax
    return None


def _kept_spec(leaf) -> Spec:
    """A good leaf's spec in the suggested fix: non-tensors get None (an explicit int would refuse them)."""
    return leaf.spec if isinstance(leaf.value, (Tensor, PackedSequence)) else None


def _scatter_message(tree, specs, mapped, bad, batch) -> str:
    bad_ids = {id(m) for m in bad}
    if batch is None:
        head = "cannot split the batch: no tensor mapped to a batch axis has a usable batch axis"
    else:
        head = (
            f"cannot split the batch: the tensors mapped to a batch axis must all have the same size B there "
            f"(B = {batch}, the size most arguments agree on)"
        )
    rows = [("path", "shape", "spec", "axis", "size", "")]
    for m in mapped:
        note = ""
        if id(m) in bad_ids:
            note = m.problem if m.problem is not None else f"expected {batch}"
            ax = _suggest_axis(m, batch)
            if isinstance(m.leaf.value, Tensor) and m.leaf.value.dim() == 0:
                note += ": replicate it with None"
            elif ax is not None:
                note += f"; axis {ax} has size {batch}"
            elif m.is_packed:
                note += "; a PackedSequence is split by sequence: give it None to replicate it"
            else:
                note += (
                    f"; no axis has size {batch}: replicate it with None"
                    if batch is not None
                    else "; replicate it with None"
                )
            note = "<- " + note
        axis = "seq" if m.is_packed else ("-" if m.axis is None else str(m.axis))
        size = "-" if m.size is None else str(m.size)
        rows.append((m.leaf.path, shape_text(m.leaf.value), repr(m.leaf.spec), axis, size, note))
    lines = [head] + ["  " + line for line in _table(rows)]
    # suggested fix: per top-level argument with a bad leaf, a spec mirroring it (collapsed when uniform)
    bad_args = sorted({m.arg for m in bad})
    mapped_by_leaf = {id(m.leaf): m for m in mapped}
    fixes: dict[str, list[Spec]] = {}
    for a in bad_args:
        leaf_specs = []
        for leaf, arg in zip(tree.leaves, tree.leaf_arg):
            if arg != a:
                continue
            m = mapped_by_leaf.get(id(leaf))
            if m is not None and id(m) in bad_ids:
                leaf_specs.append(_suggest_axis(m, batch))
            else:
                leaf_specs.append(_kept_spec(leaf))
        fixes.setdefault(tree.arg_names[a], []).append(spec_tree_repr(tree.arg_defs[a], leaf_specs))
    merged: dict[str, Spec] = {}
    for name, found in fixes.items():
        is_extra = specs.has_signature and name == specs.var_pos and tree.n_args > len(specs.pos_names)
        if is_extra:  # *args extras: one spec per extra argument
            extra = [specs.positional(i, tree.n_args)[2] for i in range(len(specs.pos_names), tree.n_args)]
            for a in bad_args:
                if tree.arg_names[a] == name:
                    extra[a - len(specs.pos_names)] = spec_tree_repr(
                        tree.arg_defs[a],
                        [
                            _suggest_axis(mapped_by_leaf[id(lf)], batch)
                            if id(lf) in mapped_by_leaf and id(mapped_by_leaf[id(lf)]) in bad_ids
                            else _kept_spec(lf)
                            for lf, ar in zip(tree.leaves, tree.leaf_arg)
                            if ar == a
                        ],
                    )
            merged[name] = tuple(extra)
        else:
            merged[name] = found[0]
    lines.append(f"suggested fix: DataParallel(..., {specs.suggestion(merged)})")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


# ---------------------------------------------------------------------------------------------------------------
# plan()
# ---------------------------------------------------------------------------------------------------------------


class Plan:
    """What one call would do: ``B``, the chunk per device, and for every leaf its shape, spec and per-replica
    chunk. ``str(plan)`` is a table; nothing is copied or computed to build it."""

    def __init__(
        self,
        mode: str,
        batch_size: int | None,
        devices: Sequence[torch.device],
        sizes: Sequence[int],
        output_device: torch.device | None,
        rows: Sequence[tuple[str, str, str, list[str]]],
        reason: str = "",
    ):
        self.reason = reason  # why a "single" plan makes one call
        self.mode = mode  # "split", "single" (one call on device_ids[0]) or "passthrough" (no device_ids)
        self.batch_size = batch_size
        self.devices = list(devices)  # every device_ids entry
        self.sizes = list(sizes)  # chunk size per device_ids entry (0: skipped)
        self.output_device = output_device
        self.rows = list(rows)  # (path, shape, spec, cells per replica)

    @property
    def replicas(self) -> list[tuple[int, torch.device, int]]:
        """``(device_ids index, device, chunk size)`` of every replica that runs."""
        if self.mode == "passthrough":
            return []
        if self.mode == "single":
            return [(0, self.devices[0], self.batch_size or 0)]
        return [(i, d, s) for i, (d, s) in enumerate(zip(self.devices, self.sizes)) if s > 0]

    def __str__(self) -> str:
        if self.mode == "passthrough":
            head = "dpfast plan: no device_ids and no CUDA: the module is called directly"
        elif self.mode == "single":
            head = f"dpfast plan: {self.reason}: one call on {self.devices[0]}, output on {self.output_device}"
            if self.reason == "one device":
                head = f"dpfast plan: one device: the module is called directly on {self.devices[0]}"
        else:
            head = (
                f"dpfast plan: B = {self.batch_size} split {self.sizes} over "
                f"{len(self.replicas)} replica{'s' if len(self.replicas) != 1 else ''}, output on "
                f"{self.output_device}"
            )
        reps = self.replicas
        header = ("path", "shape", "spec") + tuple(f"#{i} {d}" for i, d, _ in reps)
        rows = [header] + [(p, sh, sp, *cells) for p, sh, sp, cells in self.rows]
        if len(rows) == 1:
            return head + "\n  (no arguments)"
        width = len(header)
        rows = [tuple(r) + ("",) * (width - len(r)) for r in rows]
        return "\n".join([head] + ["  " + line for line in _table(rows)])

    __repr__ = __str__


def plan_rows(
    tree: ArgumentTree, mapped: Sequence[Mapped], replica_sizes: Sequence[int], single: bool
) -> list[tuple[str, str, str, list[str]]]:
    by_leaf = {id(m.leaf): m for m in mapped}
    rows = []
    n = len(replica_sizes)
    for leaf in tree.leaves:
        v = leaf.value
        m = by_leaf.get(id(leaf))
        if m is not None:
            if single:
                cells = [shape_text(v)]
            elif m.is_packed:
                cells = [f"packed(B={s})" for s in replica_sizes]
            else:
                cells = []
                for s in replica_sizes:
                    shape = list(v.shape)
                    shape[m.axis] = s
                    cells.append(str(tuple(shape)))
            rows.append((leaf.path, shape_text(v), repr(leaf.spec), cells))
        elif isinstance(v, (Tensor, PackedSequence)):
            rows.append((leaf.path, shape_text(v), repr(leaf.spec), [shape_text(v)] * n))
        elif v is None:
            rows.append((leaf.path, "None", repr(leaf.spec), ["None"] * n))
        else:
            rows.append((leaf.path, type(v).__name__, repr(leaf.spec), ["by reference"] * n))
    return rows
