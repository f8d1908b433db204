"""What the ranks must agree on, and when they compare it.

Each forward is described by a :class:`StepRecord`: a status (did this rank plan and run its share?) and a few
named items (``B``, the split, each argument's shape and dtype...) whose hash is the step's fingerprint. One row per
rank, ``(status, fingerprint, forwards)``, is compared (:class:`StepChecks`); when the rows differ, every rank calls
:func:`~dpfast.distributed.disagreement.raise_disagreement`, which raises :class:`DistributedBatchError` on every
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

Under ``join()`` a rank whose inputs ran out shadows the others' steps (torch's join hook runs DDP's collectives
for it): it sends a ``JOINED`` row, which is not compared, and no blocking check runs (the first call's included):
each step is checked in its first gradient bucket, which the joined ranks shadow too.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..plan.call_plan import CallPlan
from ..plan.render import shape_text
from ..trees.specs import Leaf
from .disagreement import CANNOT_PLAN, JOINED, NAME, OK, error_line, raise_disagreement
from .group import RankGroup


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


def _leaf_text(leaf: Leaf, per_rank: bool) -> str:
    v = leaf.value
    if leaf.split is None:  # replicated: the same tensor on every rank (per-rank inputs: its shape is the rank's)
        if not isinstance(v, Tensor):
            return f"spec {leaf.spec!r}: {type(v).__name__}"
        shape = f"{v.dim()}-dim" if per_rank else _shape_words(v)
        return f"spec {leaf.spec!r}: tensor {shape} {v.dtype}{', requires_grad' if v.requires_grad else ''}"
    if leaf.is_items:
        return f"items: {type(v).__name__}" if per_rank else f"items: {type(v).__name__}[{len(v)}]"
    data = v.data if leaf.is_packed else v
    grad = ", requires_grad" if data.requires_grad else ""
    kind = "packed " if leaf.is_packed else ""
    if per_rank:  # each rank's own rows: sizes may differ, the rest must not
        return f"{kind}{data.dim()}-dim {data.dtype}, batch axis {leaf.spec!r}{grad}"
    return f"{kind}{_shape_words(v)} {data.dtype}{grad}"


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
    else:  # (items, a PackedSequence, a jagged tensor: their shapes in words, hashed)
        shapes = tuple([_shape_key(flat[i]) for i in program.mapped])
    if program.copied:  # the replicated tensors' shapes (their dtypes are in the program's fingerprint)
        shapes += tuple([_shape_key(flat[i]) for i in program.copied])
    batch = -1 if plan.batch_size is None else plan.batch_size
    return StepRecord(OK, None, None, hash((base, batch, plan.balance is not None, tuple(plan.sizes), shapes)), plan)


def _shape_key(v: Any) -> Any:
    """A shape every process hashes alike: a plain tensor's ``torch.Size``, else its shape in words, hashed."""
    if isinstance(v, Tensor) and not v.is_nested:
        return v.shape
    return fingerprint(_shape_words(v))


def _shape_words(v: Any) -> str:
    """A shape as every process writes it: a jagged tensor's ragged size prints as a symbol each process numbers
    on its own (``(2, j1, 3)`` here, ``(2, j2, 3)`` on a rank that made one more), so it is told by its values'."""
    if isinstance(v, Tensor) and v.is_nested and v.layout == torch.jagged:
        return f"jagged(B={v.size(0)}, values={tuple(v.values().shape)})"
    return shape_text(v)


def record_of(plan: CallPlan | None, error: BaseException | None, check_batch: Any, per_rank: bool) -> StepRecord:
    """What the ranks compare of one forward, by the wrapper's ``check_batch`` (nothing when it is off)."""
    if not check_batch:
        return StepRecord(OK, error, {})
    if plan is None or check_batch == "values":
        return describe_step(plan, error, per_rank, check_batch == "values")
    return step_record(plan, per_rank)


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
    """Every rank that ran the step sent the same OK row (a joined rank's row is not compared)."""
    ran = [list(row) for row in rows if row[0] != JOINED]
    return not ran or (ran[0][0] == OK and all(row == ran[0] for row in ran))


def agree_now(
    group: Any,
    comm_device: torch.device,
    records: Sequence[StepRecord],
    name: str = NAME,
    alongside: Callable[[], Any] | None = None,
    extra: int = 0,
) -> list[int]:
    """A blocking check (one small all-gather): return when every rank's records match, else raise on every rank.
    Used for the first call and where no collective of the step can carry the check. ``alongside`` issues
    another collective while the check's is in flight, so that their round trips overlap. ``extra``: a number
    of this rank's that travels with its row uncompared; every rank's is returned, in rank order. A group of one
    has nobody to disagree with: its own status is read, and no collective runs."""
    world = dist.get_world_size(group)
    mine = chain_row(records) + [extra]
    if world == 1:
        rows = [mine]
    else:
        mine_t = torch.tensor(mine, dtype=torch.int64, device=comm_device)
        rows_t = [torch.empty_like(mine_t) for _ in range(world)]
        work = dist.all_gather(rows_t, mine_t, group=group, async_op=alongside is not None)
        if alongside is not None:
            alongside()
            work.wait()
        rows = [t.tolist() for t in rows_t]
    extras = [row.pop() for row in rows]
    if not rows_agree(rows):
        raise_disagreement(group, records, rows, name)
    return extras


class StepChecks:
    """One wrapper's checks: the forwards since the last check, and what the last checked step established (the
    collectives its forward issued, and the first rank that had rows, which DDP's buffers come from)."""

    def __init__(self, group: RankGroup, enabled: bool, name: str = NAME):
        self.group = group
        self.name = name  # the wrapper's, which heads its errors
        self.enabled = enabled
        self.records: list[StepRecord] = []
        self.checked_once = False
        self.joined = False  # under join(): this rank's inputs ran out (set while it shadows the others' steps)
        self.trace: list[tuple] | None = None  # None until a checked forward recorded one
        self.buffer_source = 0
        self.sizes_exchanged = False  # per-rank inputs: the last checked step read every rank's row count
        self._pending_trace: list[tuple] | None = None
        self._pending_source = 0
        self._pending_sizes = False

    def begin(self, record: StepRecord, joining: bool) -> None:
        """A forward starts: its record joins the chain (the first call checks it at once, before running, unless
        ``joining``: under join() a rank may have joined already, and it shadows only the step's collectives)."""
        if not self.enabled:
            return
        if not self.checked_once and not joining:  # a bad first call raises on every rank before it runs
            agree_now(self.group.process_group, self.group.comm_device, [record], self.name)
            self.checked_once = True
        self.records.append(record)  # how the forward ends (it may still fail) is checked with the step

    def check_before(self, record: StepRecord, alongside: Callable[[], Any], rows: int) -> list[int] | None:
        """A forward checked before it runs, with one small all-gather: FSDP2 leaves its step's state undefined
        after a raise that follows its forward hook, so a rank that disagrees must raise before it. ``alongside``
        starts the forward's first collective (FSDP's unshard), so that the check's round trip overlaps it.
        ``rows``: this rank's row count, which the ranks need not share; returns every rank's (``None`` when the
        checks are off)."""
        if not self.enabled:
            return None
        records, self.records = self.records + [record], []
        every_rows = agree_now(self.group.process_group, self.group.comm_device, records, self.name, alongside, rows)
        self._commit()
        return every_rows

    def ran(self, trace: list[tuple] | None, buffer_source: int) -> None:
        """What this forward did, kept until its check says it is what every rank did."""
        self._pending_trace, self._pending_source, self._pending_sizes = trace, buffer_source, False

    def exchanged_sizes(self) -> None:
        """This step read every rank's row count (a collective outside the forward: part of its pattern)."""
        self._pending_sizes = True

    def row(self) -> list[int]:
        """This rank's ``(status, fingerprint, forwards)``; zeros when the checks are off."""
        if self.joined:
            return [JOINED, 0, 0]
        return chain_row(self.records) if self.enabled else [0, 0, 0]

    def verify(self, rows: Sequence[Sequence[int]]) -> None:
        """Every rank's row (the same list on every rank): return if they agree, else raise on every rank."""
        if not self.enabled:
            return
        records, self.records = self.records, []
        if not rows_agree(rows):
            raise_disagreement(self.group.process_group, records, rows, self.name)
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
        agree_now(self.group.process_group, self.group.comm_device, records, self.name)
        self._commit()

    def _commit(self) -> None:
        if self._pending_trace is not None:
            self.trace = self._pending_trace
        self.buffer_source = self._pending_source
        self.sizes_exchanged = self._pending_sizes
