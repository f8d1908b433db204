"""The statuses a rank's step can end in, and the error every rank raises when the ranks' checks disagree.

:func:`raise_disagreement` runs on every rank once the compared rows differ (:mod:`dpfast.distributed.agreement`):
it gathers the ranks' records once and raises :class:`DistributedBatchError` with a headline saying what went wrong
and a line per rank that shows only what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..plan.errors import ScatterError

NAME = "dpfast.DistributedDataParallel"

# A step's status; the largest over the steps of one check is what that check reports.
OK = 0
CANNOT_PLAN = 1  # planning the call raised (ScatterError, a spec that does not fit, bad costs)
EMPTY_REFUSED = 2  # no rows, and the module refused an empty batch and a stand-in sample
GHOST_COUNTED = 3  # no rows, the module refused an empty batch, and the stand-in sample reached a collective
CANNOT_GATHER = 4  # gather_outputs could not sort this rank's outputs
MODULE_RAISED = 5  # the module raised on this rank's share (it still joins the step's check, so nobody waits)
JOINED = 6  # under join(): this rank's inputs ran out and it shadows the others' steps (its row is not compared)


class DistributedBatchError(ScatterError):
    """Raised on every rank when the ranks disagree, or one rank cannot run its part of the step.

    What they disagree on: the batch (its structure, dtypes, batch axes, and with the global batch ``B``, the split
    and every shape), the outputs to gather (their structure, and whether they need grad), or the wrapper's own
    settings (at construction). The message has a line per rank saying what differs. A subclass of
    :class:`dpfast.ScatterError`.
    """

    __module__ = "dpfast"  # printed and pickled as dpfast.DistributedBatchError, the name users catch it by


def error_line(e: BaseException) -> str:
    """``e`` in one line: its type and its message's first line."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def raise_disagreement(group: Any, records: Sequence[Any], rows: Sequence[Sequence[int]], name: str = NAME) -> None:
    """Every rank saw the same ``rows``, so every rank is here: one more collective for a readable message (headed
    by ``name``, the wrapper's). When every rank's module raised, each raises its own error, as it would without
    dpfast."""
    local = next((r.error for r in records if r.error is not None), None)
    if local is not None and all(row[0] == MODULE_RAISED for row in rows):
        raise local
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    joined = rows[rank][0] == JOINED
    mine = None if joined else [(r.status, r.error_line(), r.items) for r in records]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    ran = [r for r, row in enumerate(rows) if row[0] != JOINED]  # a joined rank ran no step since it joined
    lines = [f"{name}: {_headline([everyone[r] for r in ran], [rows[r] for r in ran])}"]
    lines += _rank_lines(everyone, rank)
    if local is not None and str(local):
        lines.append(str(local))  # this rank's own error in full (a ScatterError's table and suggested fix)
    raise DistributedBatchError("\n".join(lines)) from local


_STATUS_HEADLINES = {
    CANNOT_PLAN: "could not split {its} inputs, so no rank runs this step",
    EMPTY_REFUSED: (
        "{has} no rows of this batch, and {its} module could not run without them (it refused an empty batch, and "
        "with the global batch a stand-in sample too); make the module accept an empty batch (e.g. "
        "x.reshape(len(x), -1) instead of x.view(B, -1)), or give every rank rows (B >= world size, no "
        "chunk_sizes weight of 0)"
    ),
    GHOST_COUNTED: (
        "{has} no rows of this batch, and {its} module refused an empty batch; the stand-in sample it ran instead "
        "reached a collective (dpfast.nn.SyncBatchNorm, dpfast.all_gather...), where it would change the other "
        "ranks' numbers, so no rank uses this step; make the module accept an empty batch (e.g. "
        "x.reshape(len(x), -1) instead of x.view(B, -1)), or give every rank rows (B >= world size, no "
        "chunk_sizes weight of 0)"
    ),
    CANNOT_GATHER: "could not gather {its} outputs, so no rank gathers them",
    MODULE_RAISED: "raised in {its} module on the same batch as the others, so no rank uses this step",
}


def _headline(everyone: Sequence[Any], rows: Sequence[Sequence[int]]) -> str:
    worst = max(row[0] for row in rows)
    if worst == MODULE_RAISED and _first_difference(everyone)[1]:
        return _batch_headline(everyone)  # the batches differ too: the cause, of which the raise is a symptom
    if worst != OK:
        bad = [r for r, row in enumerate(rows) if row[0] == worst]
        many = len(bad) > 1
        who = f"rank{'s' if many else ''} {', '.join(map(str, bad))} "
        return who + _STATUS_HEADLINES[worst].format(its="their" if many else "its", has="have" if many else "has")
    counts = [row[2] for row in rows]
    if len(set(counts)) > 1:
        return (
            "the ranks called forward a different number of times since their last check "
            f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))}); every rank must call forward (and "
            "backward) the same number of times"
        )
    return _batch_headline(everyone)


def _first_difference(everyone: Sequence[Any]) -> tuple[int, list[str]]:
    """The first forward (of the chain) whose items differ between ranks, and the keys that differ."""
    for i in range(min(len(records) for records in everyone)):
        dicts = [records[i][2] for records in everyone]
        keys = [k for k in dict.fromkeys(k for d in dicts for k in d) if len({d.get(k) for d in dicts}) > 1]
        if keys:
            return i, keys
    return 0, []


def _batch_headline(everyone: Sequence[Any]) -> str:
    i, keys = _first_difference(everyone)
    dicts = [records[i][2] for records in everyone]
    if "B" in keys:
        bs = sorted({d.get("B", "-") for d in dicts}, key=lambda b: (len(b), b))
        return (
            f"the ranks were given different global batches: B differs across ranks ({', '.join(bs)}); every rank "
            "must get the same global batch (or pass inputs='per_rank' and give each rank its own rows)"
        )
    if keys == ["split"]:
        return (
            f"the ranks planned different splits of the same B = {dicts[0].get('B')}: their cost values differ; "
            "every rank must get the same global batch and costs"
        )
    if "B" not in dicts[0]:
        return (
            f"the ranks' batches differ in {_names(keys)} (per-rank inputs may differ in size only): every rank "
            "must pass the same structure, dtypes and batch axes"
        )
    return (
        f"the ranks were given different global batches: same B = {dicts[0].get('B')} but different {_names(keys)}; "
        "every rank must get the same global batch"
    )


def _names(keys: Sequence[str]) -> str:
    shown = [f"`{k}`" for k in keys[:4]]
    return ", ".join(shown) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _rank_lines(everyone: Sequence[Any], rank: int) -> list[str]:
    i, keys = _first_difference([records for records in everyone if records is not None])
    counts = {len(records) for records in everyone if records is not None}
    lines = []
    for r, records in enumerate(everyone):
        if records is None:
            lines.append(f"  rank {r}{' (this rank)' if r == rank else ''}: joined (its inputs ran out)")
            continue
        failed = [(status, err) for status, err, _ in records if status != OK]
        if failed and failed[0][0] == MODULE_RAISED and keys:  # what differs, then what its module raised
            d = records[i][2] if i < len(records) else {}
            text = "; ".join(f"{k}: {d.get(k, '(none)')}" for k in keys[:4]) + f" (its module raised {failed[0][1]})"
        elif failed:
            text = failed[0][1] or "failed"
        elif len(counts) > 1:
            text = f"{len(records)} forward{'s' if len(records) != 1 else ''} since the last check"
        elif keys:
            d = records[i][2] if i < len(records) else {}
            text = "; ".join(f"{k}: {d.get(k, '(none)')}" for k in keys[:4])
        else:
            d = records[-1][2] if records else {}
            text = f"ran its part (B = {d['B']})" if "B" in d else "ran its part"
        lines.append(f"  rank {r}{' (this rank)' if r == rank else ''}: {text}")
    return lines


# ---- when the ranks compare their records ----------------------------------------------------------------------------
