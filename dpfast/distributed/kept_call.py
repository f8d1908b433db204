"""A DistributedDataParallel call like the last one: cut to this rank's rows without planning it again.

A training loop calls the wrapper with the same structure every step. What planning, the step record and the
share derive from a call read along the kept skeleton is fixed by that skeleton and, per tensor, its size along
every axis, dtype, ``requires_grad``, and that it is a plain dense tensor (and on which device): the settings
are fixed once the wrapper is built. So a call of the very same skeleton whose tensors read the same (two calls
into the extension, :func:`dpfast.ops._plain_batch` and :func:`dpfast.ops._tensor_facts`) gets the last call's
record and share, and only its cut is made anew (:func:`dpfast.ops._narrow_many`, as ``cut_rows`` makes it). Both
the reading and the cut of a call like the kept one are one call into the extension (:func:`dpfast.ops._kept_cut`,
which compares the tensors with what was kept in place); where it declines, the call is read in full.

Kept only for what needs nothing per call beyond the cut: a split by count (no ``cost=``, no
``check_batch="values"``), a rank with rows, and no input that requires grad (those are seen through an autograd
node made per call). Per-rank inputs (``inputs="per_rank"``) are kept the same way, and passed on as given.
Anything else, or anything that reads differently, is planned in full, and its plan kept. A workload whose shapes
change every call (dynamic padding) would pay for a reading that never matches: after declines in a row the wrapper
plans in full without keeping, for twice as many calls each time, and tries again (:class:`KeptCalls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import ops
from ..plan.call_plan import CallPlan
from ..trees.binding import Binding, BoundArguments
from .agreement import OK, StepRecord
from .sharding import Share


class KeptCall:
    """The last planned call's skeleton and what it read of its tensors, with the record, share (None: per-rank
    inputs, of ``rows`` rows) and first rank with rows that it gave."""

    __slots__ = ("skeleton", "batch", "facts", "items", "fp", "share", "first", "declined")

    def __init__(
        self, skeleton: Any, batch: tuple, facts: tuple, record: StepRecord | None, share: Share | None, first: int
    ):
        self.skeleton, self.batch, self.facts, self.share, self.first = skeleton, batch, facts, share, first
        # (a record's items are never changed once made: StepDescriber serves one dict to many records too)
        self.items, self.fp = (None, None) if record is None else (record.items, record.fp)
        self.declined: tuple | None = None  # what the last declined call read of its tensors (see `of`)

    @property
    def rows(self) -> int:
        """``B`` of the kept call (per-rank inputs: this rank's rows)."""
        return self.batch[0]

    @classmethod
    def of(
        cls, plan: CallPlan, record: StepRecord | None, share: Share | None, first: int, read: tuple | None = None
    ) -> KeptCall | None:
        """What to keep of a call just planned in full (``record`` None: the checks are off; ``share`` None:
        per-rank inputs), or None when the next call like it must be planned in full too. ``read``: what the
        kept call read of this very call's tensors before it declined it (its ``declined``), not read again."""
        tree = plan.tree
        if plan.mode != "split" or tree.split is None or tree.flat is None or plan.balance is not None:
            return None
        if (share is not None and share.stop <= share.start) or (record is not None and record.status != OK):
            return None
        tensors = tree.skeleton.tensor_values(tree.flat)
        if any(t.requires_grad for t in tensors):
            return None
        read = read or _read(tensors, tree.skeleton.specs)
        return None if read is None else cls(tree.skeleton, *read, record, share, first)

    def take(self, binding: Binding, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, StepRecord | None] | None:
        """This rank's ``(args, kwargs)`` of a call like the kept one (per-rank inputs: as given), and its record
        (None with the checks off); None when the call must be planned in full."""
        skeleton = self.skeleton
        self.declined = None
        if binding.skeleton is not skeleton:
            return None
        tree = None
        if skeleton.flat:  # every argument one leaf (model(x)): no tree to make
            flat = skeleton.read_flat(inputs, kwargs)
        else:
            tree = BoundArguments.again(binding, skeleton, inputs, kwargs)
            flat = None if tree is None else tree.flat
        if flat is None:
            return None
        cut = self._cut(skeleton.tensor_values(flat), skeleton.specs)
        if cut is None:
            return None
        record = None if self.items is None else StepRecord(OK, None, self.items, self.fp)
        if cut is True:  # per-rank inputs: this rank's rows are all of them, passed as given
            return inputs, kwargs, record
        if len(cut) == len(flat):  # every leaf a tensor
            values = cut
        else:
            values = list(flat)
            for i, v in zip(skeleton.tensors, cut):
                values[i] = v
        args, kw = skeleton.rebuild_flat(values) if tree is None else tree.rebuild(values)
        return args, kw, record

    def _cut(self, tensors: Sequence[Any], specs: list) -> list | bool | None:
        """A call's tensors, when they read as the kept call's: cut to this rank's rows (True for per-rank inputs,
        passed as given); None when they read otherwise (or cannot be cut), and the call is planned in full."""
        share, (_, axes, index) = self.share, self.batch
        start, length = (0, -1) if share is None else (share.start, share.stop - share.start)
        cut = ops._kept_cut(tensors, self.facts, axes, index, start, length)
        if cut is not None:
            return cut
        read = _read(tensors, specs)  # the one-call check declined (or there is no extension): read in full
        if read != (self.batch, self.facts):
            # planning reads this call along the same skeleton next: what was read here need not be read again
            self.declined = read
            return None
        return True if share is None else ops._narrow_many(tensors, axes, start, length)


def _read(tensors: Sequence[Any], specs: list) -> tuple[tuple, tuple] | None:
    """What planning reads of a call's tensors (``(B, axes, device)``) and their facts (sizes, dtype,
    ``requires_grad``); None when they are not all plain (planning then walks in full)."""
    batch = ops._plain_batch(tensors, specs, True)
    facts = ops._tensor_facts(tensors) if batch is not None and batch[0] > 0 else None
    return None if facts is None else (batch, facts)


class KeptCalls:
    """One wrapper's kept call (``last``), and when to keep one: after two declines in a row, none is kept for 4,
    then 8, ... (at most 64) calls planned in full, so that calls which never repeat pay for no reading."""

    __slots__ = ("last", "misses", "pause")

    def __init__(self) -> None:
        self.last: KeptCall | None = None
        self.misses = 0  # declines in a row
        self.pause = 0  # calls left to plan in full without keeping

    def take(self, binding: Binding, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, StepRecord | None] | None:
        """:meth:`KeptCall.take` of the kept call (None when there is none)."""
        last = self.last
        if last is None:
            return None
        got = last.take(binding, inputs, kwargs)
        if got is not None:
            self.misses = 0
        return got

    def planned(self, plan: CallPlan, record: StepRecord | None, share: Share | None, first: int) -> None:
        """A call was planned in full (after :meth:`take` declined it, or with nothing kept): keep it, unless
        calls have not repeated lately."""
        last, self.last = self.last, None
        if self.pause:
            self.pause -= 1
            return
        if last is not None:  # the kept call declined this one
            self.misses += 1
            if self.misses >= 2:
                self.pause = min(1 << self.misses, 64)
                return
        self.last = KeptCall.of(plan, record, share, first, None if last is None else last.declined)

    def forget(self) -> None:
        """A call that cannot be kept (another mode, a rank without rows): nothing is kept for the next."""
        self.last = None
