"""A DistributedDataParallel call like the last one: cut to this rank's rows without planning it again.

A training loop calls the wrapper with the same structure every step. What planning, the step record and the
share derive from a call read along the kept skeleton is fixed by that skeleton and, per tensor, its size along
every axis, dtype, ``requires_grad``, and that it is a plain dense tensor (and on which device): the settings
are fixed once the wrapper is built. So a call of the very same skeleton whose tensors read the same (two calls
into the extension, :func:`dpfast.ops._plain_batch` and :func:`dpfast.ops._tensor_facts`) gets the last call's
record and share, and only its cut is made anew (:func:`dpfast.ops._narrow_many`, as ``cut_rows`` makes it).

Kept only for what needs nothing per call beyond the cut: a split by count (no ``cost=``, no
``check_batch="values"``), a rank with rows, and no input that requires grad (those are seen through an autograd
node made per call). Per-rank inputs (``inputs="per_rank"``) are kept the same way, and passed on as given.
Anything else, or anything that reads differently, is planned in full, and its plan kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import ops
from ..plan.call_plan import CallPlan
from ..trees.binding import Binding, BoundArguments
from ..trees.flatten import is_leaf
from .agreement import OK, StepRecord
from .sharding import Share


class KeptCall:
    """The last planned call's skeleton and what it read of its tensors, with the record, share (None: per-rank
    inputs, of ``rows`` rows) and first rank with rows that it gave."""

    __slots__ = ("skeleton", "batch", "facts", "record", "share", "rows", "first")

    def __init__(
        self, skeleton: Any, batch: tuple, facts: tuple, record: StepRecord | None, share: Share | None, first: int
    ):
        self.skeleton, self.batch, self.facts, self.share, self.first = skeleton, batch, facts, share, first
        self.rows = batch[0]
        # One record serves every call taken: a record changes only when its rank cannot run its part (an empty
        # share, never kept), and its items are never changed once made (StepDescriber serves one dict to many).
        self.record = None if record is None else StepRecord(OK, None, record.items, record.fp)

    @classmethod
    def of(cls, plan: CallPlan, record: StepRecord | None, share: Share | None, first: int) -> KeptCall | None:
        """What to keep of a call just planned in full (``record`` None: the checks are off; ``share`` None:
        per-rank inputs), or None when the next call like it must be planned in full too."""
        tree = plan.tree
        if plan.mode != "split" or tree.split is None or tree.flat is None or plan.balance is not None:
            return None
        if (share is not None and share.stop <= share.start) or (record is not None and record.status != OK):
            return None
        tensors = _tensors(tree.flat, tree.skeleton.tensors)
        read = _read(tensors, tree.skeleton.specs)
        if read is None or any(t.requires_grad for t in tensors):
            return None
        return cls(tree.skeleton, *read, record, share, first)

    def take(self, binding: Binding, inputs: tuple, kwargs: dict) -> tuple[tuple, dict, StepRecord | None] | None:
        """This rank's ``(args, kwargs)`` of a call like the kept one (per-rank inputs: as given), and its record
        (None with the checks off); None when the call must be planned in full."""
        skeleton = self.skeleton
        if binding.skeleton is not skeleton:
            return None
        tree = None
        if skeleton.flat:  # every argument one leaf (model(x)): read as BoundArguments.again reads it, in place
            if len(inputs) != skeleton.n_args or tuple(kwargs) != skeleton.kw_keys:
                return None
            flat = (*inputs, *kwargs.values()) if kwargs else inputs
            if not all(map(is_leaf, skeleton.args, flat)):
                return None
        else:
            tree = BoundArguments.again(binding, skeleton, inputs, kwargs)
            if tree is None:
                return None
            flat = tree.flat
        tensors = _tensors(flat, skeleton.tensors)
        if _read(tensors, skeleton.specs) != (self.batch, self.facts):
            return None
        share = self.share
        if share is None:  # per-rank inputs: this rank's rows are all of them
            return inputs, kwargs, self.record
        cut = ops._narrow_many(tensors, self.batch[1], share.start, share.stop - share.start)
        if cut is None:
            return None
        if len(cut) == len(flat):  # every leaf a tensor
            values = cut
        else:
            values = list(flat)
            for i, v in zip(skeleton.tensors, cut):
                values[i] = v
        if tree is not None:
            args, kw = tree.rebuild(values)
        else:
            n = skeleton.n_args
            args, kw = tuple(values[:n]), dict(zip(skeleton.kw_keys, values[n:]))
        return args, kw, self.record


def _tensors(flat: Sequence[Any], where: list[int]) -> Sequence[Any]:
    return flat if len(where) == len(flat) else [flat[i] for i in where]


def _read(tensors: Sequence[Any], specs: list) -> tuple[tuple, tuple] | None:
    """What planning reads of a call's tensors (``(B, axes, device)``) and their facts (sizes, dtype,
    ``requires_grad``); None when they are not all plain (planning then walks in full)."""
    batch = ops._plain_batch(tensors, specs, True)
    facts = ops._tensor_facts(tensors) if batch is not None and batch[0] > 0 else None
    return None if facts is None else (batch, facts)
