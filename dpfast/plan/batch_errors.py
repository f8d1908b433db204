"""The message of a :class:`~dpfast.ScatterError`: every mapped leaf with its shape, axis and size, the culprits
marked, and an ``in_dims`` that would fix the call (or why none can). Pure text: planning decides and raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.containers import TreeDef, key_names
from ..trees.flatten import fold
from ..trees.specs import ITEMS, Leaf, Spec, is_leaf_spec
from .render import shape_text, table


def scatter_message(tree: Any, mapped: Sequence[Leaf], bad: Sequence[Leaf], batch: int | None, chunk: int) -> str:
    """The table of every mapped leaf (culprits marked) and an ``in_dims`` that would fix the call; ``chunk`` is
    the smallest share a replica would get of ``B`` (to tell index tensors, which no spec can fix)."""
    if batch is None:
        head = "cannot split the batch: no tensor mapped to a batch axis has a usable batch axis"
    else:
        head = (
            f"cannot split the batch: the tensors mapped to a batch axis must all have the same size B there "
            f"(B = {batch}, the size most arguments agree on)"
        )
    culprits = {m.index for m in bad}
    indexes = [m for m in bad if _indexes_batch(m, batch, chunk)]
    rows = [("path", "shape", "spec", "axis", "size", "")]
    for m in mapped:
        axis = "seq" if m.is_packed else "items" if m.is_items else ("-" if m.axis is None else str(m.axis))
        size = "-" if m.size is None else str(m.size)
        note = _note(m, batch, m in indexes) if m.index in culprits else ""
        rows.append((m.path, shape_text(m.value), repr(m.spec), axis, size, note))
    lines = [head] + ["  " + line for line in table(rows)]
    if indexes:
        lines.append(_no_spec_fixes(indexes, batch, chunk))
    else:
        fixes = _fixes(tree, culprits, batch)
        lines.append(f"suggested fix: DataParallel(..., {tree.binding.suggestion(fixes)})")
    return "\n".join(lines)


def _suggest_axis(m: Leaf, batch: int | None) -> Spec:
    """An axis of the mapped leaf ``m`` that has size ``batch``, or None (replicate) when none has."""
    v = m.value
    if batch is not None and isinstance(v, Tensor) and v.is_nested:  # split along axis 0 only
        return 0 if v.size(0) == batch else None
    if batch is not None and isinstance(v, Tensor):
        for ax, s in enumerate(v.shape):
            if s == batch:
                return ax
    return None


def _kept_spec(leaf: Leaf) -> Spec:
    """A good leaf's spec in the suggested fix: non-tensors get None (an explicit int would refuse them), except a
    sequence of items, which keeps 'items'."""
    if leaf.is_items:
        return ITEMS
    return leaf.spec if isinstance(leaf.value, (Tensor, PackedSequence)) else None


def _indexes_batch(m: Leaf, batch: int | None, chunk: int) -> bool:
    """An integer tensor with no batch axis whose values look like indices into the batch (all in ``[0, B)``, some
    past a replica's share): a graph's ``edge_index`` beside its node features. It can be neither split (its
    values index the whole batch) nor replicated (each replica holds only its chunk's rows)."""
    v = m.value
    if not batch or not isinstance(v, Tensor) or v.dim() == 0 or _suggest_axis(m, batch) is not None:
        return False
    if v.is_nested or v.is_quantized or v.layout != torch.strided or v.is_meta or v.numel() == 0:
        return False
    if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
        return False
    try:
        low, high = int(v.min()), int(v.max())
    except Exception:  # noqa: BLE001 - a subclass that cannot reduce: no claim about its values
        return False
    return low >= 0 and chunk <= high < batch


def _note(m: Leaf, batch: int | None, indexes: bool) -> str:
    note = m.problem if m.problem is not None else f"expected {batch}"
    if indexes:
        return f"<- {note}; its values index the batch axis: it can be neither split nor replicated"
    ax = _suggest_axis(m, batch)
    if isinstance(m.value, Tensor) and m.value.dim() == 0:
        return f"<- {note}: replicate it with None"
    if ax is not None:
        return f"<- {note}; axis {ax} has size {batch}"
    if m.is_packed:
        return f"<- {note}; a PackedSequence is split by sequence: give it None to replicate it"
    if m.is_items:
        return f"<- {note}; it holds {m.size} items"
    if batch is not None:
        return f"<- {note}; no axis has size {batch}: replicate it with None"
    return f"<- {note}; replicate it with None"


def _no_spec_fixes(indexes: Sequence[Leaf], batch: int | None, chunk: int) -> str:
    names = ", ".join(f"`{m.path}`" for m in indexes)
    top = max(int(m.value.max()) for m in indexes)
    return (
        f"no in_dims fixes this call: {names} hold{'s' if len(indexes) == 1 else ''} indices into the batch axis "
        f"(values up to {top} with B = {batch}): split, the indices would point into other replicas' rows; "
        f"replicated (None), every replica would index rows it does not have (a replica gets as few as {chunk} of "
        f"the {batch}). Pass the batch as a list of samples instead (one graph, or one item, per entry) under "
        "'items', e.g. in_dims={'graphs': 'items'}, with cost= each sample's size (its number of nodes) to balance "
        "the work, and build the batch inside forward"
    )


def _fixes(tree: Any, culprits: set, batch: int | None) -> dict[str, Spec]:
    """Per argument name with a culprit: a spec mirroring the argument (collapsed where uniform)."""
    per_arg: dict[int, list[Spec]] = {}
    for leaf in tree.leaves:
        bad = leaf.index in culprits
        per_arg.setdefault(leaf.arg, []).append(_suggest_axis(leaf, batch) if bad else _kept_spec(leaf))
    bad_args = sorted({leaf.arg for leaf in tree.leaves if leaf.index in culprits})
    binding = tree.binding
    fixes: dict[str, Spec] = {}
    n_pos = len(binding.pos_names)
    for a in bad_args:
        name = tree.arg_names[a]
        spec = _suggested_spec(tree.arg_defs[a], per_arg[a], batch)
        if binding.has_signature and name == binding.var_pos and tree.n_args > n_pos:
            # *args extras: one spec per extra argument, the given ones kept
            if name not in fixes:
                fixes[name] = [binding.positional(i, tree.n_args)[2] for i in range(n_pos, tree.n_args)]
            fixes[name][a - n_pos] = spec
        else:
            fixes.setdefault(name, spec)
    return {k: tuple(v) if isinstance(v, list) and k == binding.var_pos else v for k, v in fixes.items()}


def _suggested_spec(tdef: TreeDef, leaf_specs: list[Spec], batch: int | None) -> Spec:
    """A spec mirroring ``tdef`` with the given leaf specs, collapsed where uniform, with ``'items'`` for every
    list/tuple of ``B`` tensors whose shapes differ (per-sample tensors of different lengths: a spec per element
    would give every replica all of them)."""

    def combine(node: TreeDef, children: list[tuple[Spec, bool]]) -> tuple[Spec, bool]:
        if _is_items_list(node, batch):
            return ITEMS, True
        specs = [s for s, _ in children]
        items_below = any(i for _, i in children)
        if not items_below and all(is_leaf_spec(s) for s in specs) and len(set(map(repr, specs))) == 1:
            return specs[0], False
        if node.kind in ("dict", "dataclass", "object"):
            return dict(zip(node.keys, specs)), items_below
        if node.kind == "pytree" and not all(isinstance(k, int) for k in node.keys):
            return dict(zip(key_names(node.kind, node.keys), specs)), items_below
        return tuple(specs), items_below

    return fold(tdef, ((s, False) for s in leaf_specs), combine)[0]


def _is_items_list(tdef: TreeDef, batch: int | None) -> bool:
    if tdef.kind not in ("list", "tuple") or not batch or len(tdef.children) != batch:
        return False
    values = tdef.orig_values
    return all(isinstance(v, Tensor) and not v.is_nested for v in values) and len({v.shape for v in values}) > 1


def whole_sequence_hint(tree: Any, batch: int | None) -> str:
    """For a replica's error: the arguments that are lists or tuples of ``B`` entries without a tensor, passed whole
    to every replica under the default spec, which may hold one entry per sample (``""`` when none is)."""
    if not batch:
        return ""
    names = []
    for (name, path, _, explicit), value in zip(tree._bound, tree.values):
        if explicit or type(value) not in (list, tuple) or len(value) != batch:
            continue
        if tree.binding.has_signature and path != name:  # (one of *args: no in_dims key names it alone)
            continue
        if not any(isinstance(v, (Tensor, PackedSequence)) for v in value):
            names.append((path, type(value).__name__))
    if not names:
        return ""
    what = "; ".join(f"`{p}` is a {kind} of {batch} entries" for p, kind in names)
    fix = tree.binding.suggestion({p: ITEMS for p, _ in names})
    return (
        f". Note: {what}, as many as B, passed whole to every replica (only tensors are split): if it holds one "
        f"entry per sample, give it the spec 'items' ({fix}) or pass it as a tensor"
    )
