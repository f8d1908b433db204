"""What the ranks must agree on, when they compare it, and the error every rank raises when they do not.

Each forward is described by a :class:`StepRecord`: a status (did this rank plan and run its share?) and a few
named items (``B``, the split, each argument's shape and dtype...) whose hash is the step's fingerprint. One row per
rank, ``(status, fingerprint, forwards)``, is compared (:class:`StepChecks`); when the rows differ, every rank calls
:func:`raise_disagreement`, which gathers the ranks' records once and raises :class:`DistributedBatchError` on every
rank with a line per rank that shows only what differs.

When: every forward appends its record to a chain, whose row travels with a collective the step runs anyway: with
``gather_outputs``, in the header of the output all-gather (in forward); without it, in DDP's first gradient bucket
(:mod:`dpfast.distributed.bucket_check`), read when ``backward()`` ends, before any optimizer step can use the
gradients (under ``no_sync()`` the chain grows until the next synchronized backward); under ``torch.no_grad()``
without ``gather_outputs`` no collective runs, so one small all-gather checks the forward (:func:`agree_now`); so
does the first call, before its forward. Until a check, every rank runs its own plan, so the collectives of a step
must be the same on every rank whatever the batches: a rank that cannot run its part (it could not plan its call,
its module raised, or refused its empty share) still issues them (:mod:`dpfast.distributed.empty_ranks`), then the
check, where its status makes every rank raise.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..plan.call_plan import CallPlan
from ..plan.errors import ScatterError
from ..plan.render import shape_text
from ..trees.specs import Leaf
from .group import RankGroup

NAME = "dpfast.DistributedDataParallel"

# A step's status; the largest over the steps of one check is what that check reports.
OK = 0
CANNOT_PLAN = 1  # planning the call raised (ScatterError, a spec that does not fit, bad costs)
EMPTY_REFUSED = 2  # no rows, and the module refused an empty batch and a stand-in sample
GHOST_COUNTED = 3  # no rows, the module refused an empty batch, and the stand-in sample reached a collective
CANNOT_GATHER = 4  # gather_outputs could not sort this rank's outputs
MODULE_RAISED = 5  # the module raised on this rank's share (it still joins the step's check, so nobody waits)


class DistributedBatchError(ScatterError):
    """Raised on every rank when the ranks disagree, or one rank cannot run its part of the step.

    What they disagree on: the batch (its structure, dtypes, batch axes, and with the global batch ``B``, the split
    and every shape), the outputs to gather (their structure, and whether they need grad), or the wrapper's own
    settings (at construction). The message has a line per rank saying what differs. A subclass of
    :class:`dpfast.ScatterError`.
    """

    __module__ = "dpfast"  # printed and pickled as dpfast.DistributedBatchError, the name users catch it by


def fingerprint(items: Any) -> int:
    """A 64-bit hash of ``repr(items)``, the same in every process (Python's own ``hash`` of a str is not)."""
    h = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


class StepRecord:
    """One rank's forward as the checks see it: its status, and ``items`` (name -> text), what the ranks compare,
    by their fingerprint ``fp``. A step that planned gets its fingerprint from its call program's, made once per
    key, and what its call adds (with the global batch: ``B``, the split, the split leaves' shapes); its items are
    put into words from its ``plan`` only when the ranks disagree."""

    __slots__ = ("status", "error", "_items", "_fp", "_plan", "_per_rank")

    def __init__(
        self,
        status: int,
        error: BaseException | None,
        items: dict[str, str] | None = None,
        fp: int | None = None,
        plan: CallPlan | None = None,
        per_rank: bool = False,
    ) -> None:
        self.status, self.error, self._items, self._fp = status, error, items, fp
        self._plan, self._per_rank = plan, per_rank

    @property
    def items(self) -> dict[str, str]:
        if self._items is None:
            plan, self._plan = self._plan, None  # (it holds the call's values: let them go)
            self._items = describe_step(plan, None, self._per_rank, False).items if plan is not None else {}
        return self._items

    @property
    def fp(self) -> int:
        if self._fp is None:  # computed when a check needs it (never with check_batch=False)
            self._fp = fingerprint((self.status, list(self.items.items())))
        return self._fp

    def fail(self, status: int, error: BaseException) -> None:
        """This rank could not run its part after all (e.g. its module refused its empty share)."""
        self.status, self.error, self._fp = max(self.status, status), error, None

    def error_line(self) -> str:
        return "" if self.error is None else error_line(self.error)


def error_line(e: BaseException) -> str:
    """``e`` in one line: its type and its message's first line."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _leaf_text(leaf: Leaf, per_rank: bool) -> str:
    v = leaf.value
    if leaf.split is None:
        kind = f"tensor(requires_grad={v.requires_grad})" if isinstance(v, Tensor) else type(v).__name__
        return f"spec {leaf.spec!r}: {kind}"
    if leaf.is_items:
        return f"items: {type(v).__name__}" if per_rank else f"items: {type(v).__name__}[{len(v)}]"
    data = v.data if leaf.is_packed else v
    grad = ", requires_grad" if data.requires_grad else ""
    kind = "packed " if leaf.is_packed else ""
    if per_rank:  # each rank's own rows: sizes may differ, the rest must not
        return f"{kind}{data.dim()}-dim {data.dtype}, batch axis {leaf.spec!r}{grad}"
    return f"{kind}{shape_text(v)} {data.dtype}{grad}"


def _values_hash(leaf: Leaf) -> str:
    v = leaf.value
    if leaf.is_items:
        return fingerprint(v).to_bytes(8, "little", signed=True).hex()
    t = (v.data if leaf.is_packed else v).detach().contiguous().cpu()
    return hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def describe_step(plan: CallPlan | None, error: BaseException | None, per_rank: bool, hash_values: bool) -> StepRecord:
    """The record of one forward: its status and what the ranks must agree on (in per-rank mode each rank's own
    rows: the structure, dtypes and batch axes, not the sizes)."""
    if plan is None:
        return StepRecord(CANNOT_PLAN, error, {})
    tree = plan.tree
    items: dict[str, str] = {"arguments": f"{tree.n_args} positional, keywords {list(tree.kw_keys)}"}
    if not per_rank:
        items["B"] = "-" if plan.batch_size is None else str(plan.batch_size)
        items["split"] = f"{list(plan.sizes)}{' by cost' if plan.balance is not None else ''}"
    for leaf in tree.leaves:
        items[leaf.path] = _leaf_text(leaf, per_rank)
        if hash_values and leaf.split is not None:
            items[f"{leaf.path} values"] = _values_hash(leaf)
    return StepRecord(OK, None, items)


def step_record(plan: CallPlan, per_rank: bool) -> StepRecord:
    """The record of a forward that planned: its fingerprint from the call program's (made at the key's first
    call: the structure, specs, dtypes, dims and batch axes) and, with the global batch, from what this call adds
    (``B``, the split, the split leaves' shapes): ints, which every process hashes alike. Its items are put into
    words only when the ranks disagree."""
    program = plan.tree.program
    base = program.fingerprint
    if base is None:
        base = program.fingerprint = fingerprint(list(describe_step(plan, None, True, False).items.items()))
    if per_rank:
        return StepRecord(OK, None, None, base, plan, True)
    flat = plan.tree.flat
    if program.only_tensors:
        shapes = tuple([flat[i].shape for i in program.mapped])
    else:  # (items, a PackedSequence, a jagged tensor: their shapes in words)
        shapes = tuple(
            [flat[i].shape if k == "tensor" else shape_text(flat[i]) for i, k in zip(program.mapped, program.kinds)]
        )
        shapes = (fingerprint(shapes),)
    batch = -1 if plan.batch_size is None else plan.batch_size
    return StepRecord(OK, None, None, hash((base, batch, plan.balance is not None, tuple(plan.sizes), shapes)), plan)


def chain_row(records: Sequence[StepRecord]) -> list[int]:
    """``(status, fingerprint, forwards)`` of the forwards since the last check: what one rank contributes."""
    if len(records) == 1:  # a step's chain, most often
        r = records[0]
        return [r.status, chain_fingerprint((r.fp,)), 1]
    status = max((r.status for r in records), default=OK)
    return [status, chain_fingerprint(tuple([r.fp for r in records])), len(records)]


@functools.lru_cache(maxsize=256)
def chain_fingerprint(fps: tuple[int, ...]) -> int:
    """The fingerprint of a chain of records' fingerprints (a step's chain is most often the last step's)."""
    return fingerprint(list(fps))


def rows_agree(rows: Sequence[Sequence[int]]) -> bool:
    return rows[0][0] == OK and all(list(row) == list(rows[0]) for row in rows)


def agree_now(group: Any, comm_device: torch.device, records: Sequence[StepRecord]) -> None:
    """A blocking check (one small all-gather): return when every rank's records match, else raise on every rank.
    Used for the first call and where no collective of the step can carry the check."""
    world = dist.get_world_size(group)
    mine = torch.tensor(chain_row(records), dtype=torch.int64, device=comm_device)
    rows_t = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows_t, mine, group=group)
    rows = [t.tolist() for t in rows_t]
    if not rows_agree(rows):
        raise_disagreement(group, records, rows)


def raise_disagreement(group: Any, records: Sequence[StepRecord], rows: Sequence[Sequence[int]]) -> None:
    """Every rank saw the same ``rows``, so every rank is here: one more collective for a readable message. When
    every rank's module raised, each raises its own error, as it would without dpfast."""
    local = next((r.error for r in records if r.error is not None), None)
    if local is not None and all(row[0] == MODULE_RAISED for row in rows):
        raise local
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = [(r.status, r.error_line(), r.items) for r in records]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    lines = [f"{NAME}: {_headline(everyone, rows)}"]
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
    i, keys = _first_difference(everyone)
    counts = {len(records) for records in everyone}
    lines = []
    for r, records in enumerate(everyone):
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


class StepChecks:
    """One wrapper's checks: the forwards since the last check, and what the last checked step established (the
    collectives its forward issued, and the first rank that had rows, which DDP's buffers come from)."""

    def __init__(self, group: RankGroup, enabled: bool):
        self.group = group
        self.enabled = enabled
        self.records: list[StepRecord] = []
        self.checked_once = False
        self.trace: list[tuple] | None = None  # None until a checked forward recorded one
        self.buffer_source = 0
        self.sizes_exchanged = False  # per-rank inputs: the last checked step read every rank's row count
        self._pending_trace: list[tuple] | None = None
        self._pending_source = 0
        self._pending_sizes = False

    def begin(self, record: StepRecord) -> None:
        """A forward starts: its record joins the chain (the first call checks it at once, before running)."""
        if not self.enabled:
            return
        if not self.checked_once:  # nothing ran yet: a bad first call raises on every rank before it runs
            agree_now(self.group.process_group, self.group.comm_device, [record])
            self.checked_once = True
        self.records.append(record)  # how the forward ends (it may still fail) is checked with the step

    def ran(self, trace: list[tuple] | None, buffer_source: int) -> None:
        """What this forward did, kept until its check says it is what every rank did."""
        self._pending_trace, self._pending_source, self._pending_sizes = trace, buffer_source, False

    def exchanged_sizes(self) -> None:
        """This step read every rank's row count (a collective outside the forward: part of its pattern)."""
        self._pending_sizes = True

    def row(self) -> list[int]:
        """This rank's ``(status, fingerprint, forwards)``; zeros when the checks are off."""
        return chain_row(self.records) if self.enabled else [0, 0, 0]

    def verify(self, rows: Sequence[Sequence[int]]) -> None:
        """Every rank's row (the same list on every rank): return if they agree, else raise on every rank."""
        if not self.enabled:
            return
        records, self.records = self.records, []
        if not rows_agree(rows):
            raise_disagreement(self.group.process_group, records, rows)
        self._commit()

    def agreed(self) -> None:
        """Every rank's row is this rank's, and says OK (compared where the rows are: the C++ hook)."""
        if not self.enabled:
            return
        self.records = []
        self._commit()

    def check_now(self) -> None:
        """A blocking check of the chain (the first call, and forwards no other collective can carry)."""
        if not self.enabled:
            return
        records, self.records = self.records, []
        agree_now(self.group.process_group, self.group.comm_device, records)
        self._commit()

    def _commit(self) -> None:
        if self._pending_trace is not None:
            self.trace = self._pending_trace
        self.buffer_source = self._pending_source
        self.sizes_exchanged = self._pending_sizes
