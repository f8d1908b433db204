"""The tables dpfast prints: the ``plan()`` of a call (and the columns :mod:`dpfast.plan.batch_errors` shares).

Pure text: nothing here decides anything about a call. The planning stage (:mod:`dpfast.plan.call_plan`) decides and
raises; this module words it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.containers import packed_batch


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
    split = plan.mode == "split"
    n = len(replica_sizes)
    rows = []
    for leaf in plan.tree.leaves:
        v = leaf.value
        if split and leaf.split is not None:
            if leaf.split == "packed":
                cells = [f"packed(B={s})" for s in replica_sizes]
            elif leaf.split == "items":
                cells = [f"{type(v).__name__}[{s}]" for s in replica_sizes]
            else:
                cells = []
                for s in replica_sizes:
                    shape = list(v.shape)
                    shape[leaf.axis] = s
                    cells.append(str(tuple(shape)))
        elif isinstance(v, (Tensor, PackedSequence)):
            cells = [shape_text(v)] * n
        elif v is None:
            cells = ["None"] * n
        else:
            cells = ["by reference"] * n
        rows.append((leaf.path, "None" if v is None else shape_text(v), repr(leaf.spec), cells))
    return rows
