"""The message of a :class:`~dpfast.ScatterError`: every mapped leaf with its shape, axis and size, the culprits
marked, and an ``in_dims`` that would fix the call (or why none can). Pure text: planning decides and raises."""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.containers import LEAF, TreeDef, key_names
from ..trees.flatten import fold
from ..trees.specs import ITEMS, Leaf, Spec, is_leaf_spec
from .readings import Reading, pick, readings
from .render import shape_text, table
from .splits import split_sizes

PlansTo = Callable[[dict, int], bool]  # whether the call, with these in_dims fixes, splits into this B


def scatter_message(
    tree: Any, mapped: Sequence[Leaf], vote: int | None, parts: int, weights: Any, plans_to: PlansTo
) -> str:
    """The table of every mapped leaf (culprits marked) and an ``in_dims`` that would fix the call, offered only
    when ``plans_to`` says the call splits into that ``B`` with it; or, where several readings of ``B`` fit
    (:mod:`dpfast.plan.readings`), each with its fix, to choose from. ``vote``: the size most arguments agree on."""
    picked, listed = None, []
    if _replicates_an_argument(tree, mapped, vote):  # (the vote may be a sequence length: look at every reading)
        picked, listed = pick(readings(mapped), vote)
    batch = picked.batch if picked is not None else vote
    if batch is None:
        head = "cannot split the batch: no tensor mapped to a batch axis has a usable batch axis"
    else:
        why = "the size most arguments agree on" if batch == vote else "the size that splits the most arguments"
        head = (
            f"cannot split the batch: the tensors mapped to a batch axis must all have the same size B there "
            f"(B = {batch}, {why})"
        )
    bad = [m for m in mapped if m.problem is not None or m.size != batch]
    chunk = min((s for s in split_sizes(batch, parts, weights) if s > 0), default=0) if batch else 0
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
    elif listed:
        lines += _choices(tree, listed, vote, plans_to)
    else:
        lines.append(_one_fix(tree, culprits, batch, picked if batch != vote else None, plans_to))
    return "\n".join(lines)


def _replicates_an_argument(tree: Any, mapped: Sequence[Leaf], vote: int | None) -> bool:
    """Whether the fix for ``B = vote`` replicates a tensor that is a whole argument (no axis of it has that size)."""
    for m in mapped:
        whole_tensor = tree.arg_defs[m.arg] is LEAF and isinstance(m.value, Tensor) and m.value.dim() > 0
        if m.size != vote and whole_tensor and _suggest_axis(m, vote) is None:
            return True
    return False


def _one_fix(tree: Any, culprits: set, batch: int | None, picked: Reading | None, plans_to: PlansTo) -> str:
    """The fix for ``B = batch``: a culprit on an axis of that size, or (``picked``: another reading than the
    vote's) where the reading puts it."""
    fixes = _fixes(tree, culprits, batch, picked.specs if picked is not None else None)
    if batch is not None and not plans_to(fixes, batch):
        return (
            f"no in_dims found that splits this call's arguments into B = {batch}: give each argument its batch "
            "axis, None for one without, 'items' for a list of per-sample items"
        )
    return f"suggested fix: {tree.binding.caller}(..., {tree.binding.suggestion(fixes)})"


def _choices(tree: Any, listed: Sequence[Reading], vote: int | None, plans_to: PlansTo) -> list[str]:
    """Each reading's fix (those that plan the call), to choose from: which one is meant, only the user knows."""
    offered = []
    for r in listed:
        bad = {i for i, spec in r.specs.items() if spec != tree.leaves[i].spec}
        fixes = _fixes(tree, bad, r.batch, r.specs if r.batch != vote else None)
        if plans_to(fixes, r.batch):
            offered.append((r, tree.binding.suggestion(fixes)))
    if not offered:
        return ["no in_dims found that splits this call's arguments into one B: give each argument its batch axis, "
                "None for one without, 'items' for a list of per-sample items"]  # fmt: skip
    if len(offered) == 1:
        return [f"suggested fix: {tree.binding.caller}(..., {offered[0][1]})"]
    lines = ["several sizes could be B here, so none is picked: say which with in_dims (each of these plans the call)"]
    for r, text in offered:
        replicated = _replicated(tree, r)
        note = f" (replicating {', '.join(replicated)})" if replicated else ""
        lines.append(f"  B = {r.batch}: {tree.binding.caller}(..., {text}){note}")
    return lines


def _replicated(tree: Any, r: Reading) -> list[str]:
    return [f"`{tree.leaves[i].path}`" for i, spec in r.specs.items() if spec is None]


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


def _fixes(tree: Any, culprits: set, batch: int | None, specs: dict[int, Spec] | None = None) -> dict[str, Spec]:
    """Per argument name with a culprit: a spec mirroring the argument (collapsed where uniform); a culprit's spec
    from ``specs`` (a reading's) where given, else an axis of size ``batch``."""
    per_arg: dict[int, list[Spec]] = {}
    for leaf in tree.leaves:
        if leaf.index not in culprits:
            spec = _kept_spec(leaf)
        else:
            spec = specs.get(leaf.index) if specs is not None else _suggest_axis(leaf, batch)
        per_arg.setdefault(leaf.arg, []).append(spec)
    bad_args = sorted({leaf.arg for leaf in tree.leaves if leaf.index in culprits})
    binding = tree.binding
    fixes: dict[str, Spec] = {}
    n_pos = len(binding.pos_names)
    for a in bad_args:
        name = tree.arg_names[a]
        spec = _suggested_spec(tree.arg_defs[a], per_arg[a], batch, binding.default)
        if binding.has_signature and name == binding.var_pos and tree.n_args > n_pos:
            # *args extras: one spec per extra argument, the given ones kept
            if name not in fixes:
                fixes[name] = [binding.positional(i, tree.n_args)[2] for i in range(n_pos, tree.n_args)]
            fixes[name][a - n_pos] = spec
        else:
            fixes.setdefault(name, spec)
    return {k: tuple(v) if isinstance(v, list) and k == binding.var_pos else v for k, v in fixes.items()}


def _suggested_spec(tdef: TreeDef, leaf_specs: list[Spec], batch: int | None, default: Spec) -> Spec:
    """A spec mirroring ``tdef`` with the given leaf specs, collapsed where uniform, with ``'items'`` for every
    list/tuple of ``B`` tensors whose shapes differ (per-sample tensors of different lengths: a spec per element
    would give every replica all of them). A dict's, dataclass's or object's spec names only the entries whose spec
    is not ``default`` (what an entry it does not name gets)."""

    def combine(node: TreeDef, children: list[tuple[Spec, bool]]) -> tuple[Spec, bool]:
        if _is_items_list(node, batch):
            return ITEMS, True
        specs = [s for s, _ in children]
        items_below = any(i for _, i in children)
        if not items_below and all(is_leaf_spec(s) for s in specs) and len(set(map(repr, specs))) == 1:
            return specs[0], False
        if node.kind in ("dict", "dataclass", "object"):
            values = node.orig_values if len(node.orig_values) == len(specs) else (_TENSOR,) * len(specs)
            named = {k: s for k, s, v in zip(node.keys, specs, values) if not _as_unnamed(s, v, default)}
            return (named or default), items_below
        if node.kind == "pytree" and not all(isinstance(k, int) for k in node.keys):
            return dict(zip(key_names(node.kind, node.keys), specs)), items_below
        return tuple(specs), items_below

    return fold(tdef, ((s, False) for s in leaf_specs), combine)[0]


_TENSOR = object()  # (a child whose value is not known: named whenever its spec is not the default)


def _as_unnamed(spec: Spec, value: Any, default: Spec) -> bool:
    """An entry a dict's, dataclass's or object's spec need not name: its spec is the default, or it is ``None``
    for a plain value (``None``, a number, a string, an Enum: darts' unset covariates and its stage), which the
    default passes whole too, an inherited spec being no explicit one."""
    if not is_leaf_spec(spec):
        return False
    return spec == default or (spec is None and (value is None or isinstance(value, (numbers.Number, str, enum.Enum))))


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
