"""Every table dpfast prints: the ``plan()`` of a call, and the :class:`~dpfast.ScatterError` with its suggested fix.

Pure text: nothing here decides anything about a call. The planning stage (:mod:`dpfast.plan.call_plan`) decides and
raises; this module words it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.flatten import packed_batch
from ..trees.specs import ITEMS, Spec, spec_tree_repr


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart; rows may be shorter than the header."""
    width = max(len(r) for r in rows)
    rows = [tuple(r) + ("",) * (width - len(r)) for r in rows]
    widths = [max(len(r[c]) for r in rows) for c in range(width)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def shape_text(v: Any) -> str:
    if isinstance(v, Tensor):
        if v.is_nested and v.layout != torch.jagged:
            return f"nested({v.size(0)}, {v.layout})"
        return str(tuple(v.shape))
    if isinstance(v, PackedSequence):
        return f"packed(B={packed_batch(v)}, data={tuple(v.data.shape)})"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{len(v)}]"
    return type(v).__name__


# ---- ScatterError ------------------------------------------------------------------------------------------------


def _suggest_axis(m: Any, batch: int | None) -> Spec:
    """An axis of the mapped leaf ``m`` that has size ``batch``, or None (replicate) when none has."""
    v = m.leaf.value
    if batch is not None and isinstance(v, Tensor) and v.is_nested:  # split along axis 0 only
        return 0 if v.size(0) == batch else None
    if batch is not None and isinstance(v, Tensor):
        for ax, s in enumerate(v.shape):
            if s == batch:
                return ax
    return None


def _kept_spec(leaf: Any) -> Spec:
    """A good leaf's spec in the suggested fix: non-tensors get None (an explicit int would refuse them)."""
    return leaf.spec if isinstance(leaf.value, (Tensor, PackedSequence)) else None


def _note(m: Any, batch: int | None) -> str:
    note = m.problem if m.problem is not None else f"expected {batch}"
    ax = _suggest_axis(m, batch)
    if isinstance(m.leaf.value, Tensor) and m.leaf.value.dim() == 0:
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


def scatter_message(tree: Any, specs: Any, mapped: Sequence[Any], bad: Sequence[Any], batch: int | None) -> str:
    """The table of every mapped tensor (culprits marked) and an ``in_dims`` that would fix the call."""
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
        axis = "seq" if m.is_packed else "items" if m.is_items else ("-" if m.axis is None else str(m.axis))
        size = "-" if m.size is None else str(m.size)
        note = _note(m, batch) if id(m) in bad_ids else ""
        rows.append((m.leaf.path, shape_text(m.leaf.value), repr(m.leaf.spec), axis, size, note))
    lines = [head] + ["  " + line for line in table(rows)]
    lines.append(f"suggested fix: DataParallel(..., {specs.suggestion(_fixes(tree, specs, mapped, bad_ids, batch))})")
    return "\n".join(lines)


def _fixes(tree: Any, specs: Any, mapped: Sequence[Any], bad_ids: set, batch: int | None) -> dict[str, Spec]:
    """Per argument name with a bad leaf: a spec mirroring the argument (collapsed where uniform)."""
    by_leaf = {id(m.leaf): m for m in mapped}

    def arg_spec(a: int) -> Spec:
        leaf_specs = []
        for leaf, arg in zip(tree.leaves, tree.leaf_arg):
            if arg == a:
                m = by_leaf.get(id(leaf))
                leaf_specs.append(_suggest_axis(m, batch) if m is not None and id(m) in bad_ids else _kept_spec(leaf))
        return _items_where_sizes_differ(spec_tree_repr(tree.arg_defs[a], leaf_specs), tree.arg_defs[a], batch)

    bad_args = sorted({m.arg for m in mapped if id(m) in bad_ids})
    fixes: dict[str, Spec] = {}
    n_pos = len(specs.pos_names)
    for a in bad_args:
        name = tree.arg_names[a]
        if specs.has_signature and name == specs.var_pos and tree.n_args > n_pos:
            # *args extras: one spec per extra argument, the given ones kept
            if name not in fixes:
                fixes[name] = [specs.positional(i, tree.n_args)[2] for i in range(n_pos, tree.n_args)]
            fixes[name][a - n_pos] = arg_spec(a)
        else:
            fixes.setdefault(name, arg_spec(a))
    return {k: tuple(v) if isinstance(v, list) and k == specs.var_pos else v for k, v in fixes.items()}


def _items_where_sizes_differ(spec: Spec, tdef: Any, batch: int | None) -> Spec:
    """In a suggested spec, ``'items'`` for every list/tuple of ``B`` tensors whose shapes differ (per-sample
    tensors of different lengths): a spec per element would give every replica all of them."""
    if _is_items_list(tdef, batch):
        return ITEMS
    if tdef.kind == "leaf" or not _has_items_list(tdef, batch):
        return spec
    n = len(tdef.children)
    if isinstance(spec, dict):
        specs = list(spec.values())
    else:
        specs = list(spec) if isinstance(spec, (tuple, list)) and len(spec) == n else [spec] * n
    new = [_items_where_sizes_differ(sp, c, batch) for sp, c in zip(specs, tdef.children)]
    if tdef.kind in ("tuple", "list", "namedtuple") or (tdef.kind == "pytree" and not isinstance(spec, dict)):
        return tuple(new)
    return dict(zip(spec if isinstance(spec, dict) else tdef.keys, new))


def _is_items_list(tdef: Any, batch: int | None) -> bool:
    if tdef.kind not in ("list", "tuple") or not batch or len(tdef.children) != batch:
        return False
    values = tdef.orig_values
    return all(isinstance(v, Tensor) and not v.is_nested for v in values) and len({v.shape for v in values}) > 1


def _has_items_list(tdef: Any, batch: int | None) -> bool:
    return _is_items_list(tdef, batch) or any(_has_items_list(c, batch) for c in tdef.children)


# ---- plan() ------------------------------------------------------------------------------------------------------


def plan_text(plan: Any) -> str:
    """``str()`` of a :class:`~dpfast.plan.call_plan.CallPlan`: a headline, then one row per argument leaf with its
    shape, spec and what each replica gets."""
    mode = plan.mode
    if mode == "passthrough":
        head = "dpfast plan: no device_ids and no CUDA: the module is called directly"
    elif mode == "direct":
        head = f"dpfast plan: one device: the module is called directly on {plan.devices[0]}"
    elif mode == "once":
        head = f"dpfast plan: {plan.reason}: one call on {plan.devices[0]}, output on {plan.output_device}"
    else:
        n = len(plan.replicas)
        head = (
            f"dpfast plan: B = {plan.batch_size} split {plan.sizes}{' by cost' if plan.balance else ''} over {n} "
            f"replica{'s' if n != 1 else ''}, output on {plan.output_device}"
        )
        if plan.balance is not None:
            head += "\n" + "\n".join("  " + line for line in balance_lines(plan.balance, plan.sizes))
    reps = plan.replicas
    header = ("path", "shape", "spec") + tuple(f"#{i} {d}" for i, d, _ in reps)
    rows = [header] + [(p, sh, sp, *cells) for p, sh, sp, cells in _leaf_rows(plan, [s for _, _, s in reps])]
    if len(rows) == 1:
        return head + "\n  (no arguments)"
    return "\n".join([head] + ["  " + line for line in table(rows)])


def _number(x: Any) -> str:
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def balance_lines(balance: Any, sizes: Sequence[int]) -> list[str]:
    """Each device's cost and the largest-to-mean ratio, for this split and for the count split."""
    costs = "[" + ", ".join(map(_number, balance.costs)) + "]"
    count = "[" + ", ".join(map(_number, balance.count_costs)) + "]"
    rel = " (relative to chunk_sizes)" if balance.weighted else ""
    lines = [f"cost {balance.label} per device: {costs}, largest/mean {balance.imbalance:.2f}{rel}"]
    if list(sizes) == balance.count_sizes:
        lines.append(
            f"the count split {balance.count_sizes} is the same (cost {count}, largest/mean "
            f"{balance.count_imbalance:.2f})"
        )
    else:
        lines.append(
            f"the count split {balance.count_sizes} would cost {count}, largest/mean {balance.count_imbalance:.2f}"
        )
    return lines


def _leaf_rows(plan: Any, replica_sizes: Sequence[int]) -> list[tuple[str, str, str, list[str]]]:
    by_leaf = {id(m.leaf): m for m in plan.mapped}
    split = plan.mode == "split"
    n = len(replica_sizes)
    rows = []
    for leaf in plan.tree.leaves:
        v = leaf.value
        m = by_leaf.get(id(leaf))
        if m is not None and split:
            if m.is_packed:
                cells = [f"packed(B={s})" for s in replica_sizes]
            elif m.is_items:
                cells = [f"{type(v).__name__}[{s}]" for s in replica_sizes]
            else:
                cells = []
                for s in replica_sizes:
                    shape = list(v.shape)
                    shape[m.axis] = s
                    cells.append(str(tuple(shape)))
        elif isinstance(v, (Tensor, PackedSequence)):
            cells = [shape_text(v)] * n
        elif v is None:
            cells = ["None"] * n
        else:
            cells = ["by reference"] * n
        rows.append((leaf.path, "None" if v is None else shape_text(v), repr(leaf.spec), cells))
    return rows
