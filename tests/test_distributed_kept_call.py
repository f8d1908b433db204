"""dpfast.distributed.kept_call: a DistributedDataParallel call like the last one reuses its record and share and
is only cut anew. It must never serve what the full path would not give: for every call it takes, this rank's
rows are the very views the full walk cuts and the record is the full walk's; a call that differs in anything
planning, the record or the share read (shape, dtype, requires_grad, structure, a non-plain tensor) is declined.
Planned without a process group (the planning stage is the same), against a fresh Binding that walks in full."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_distributed_step_records import (
    BASE,
    CHANGES,
    IN_DIMS,
    _call,
    _forward,
    _full_plan,
    _same_views,
    calls,
)

from dpfast.distributed.agreement import StepDescriber, describe_step
from dpfast.distributed.kept_call import KeptCall, KeptCalls
from dpfast.distributed.sharding import _share_of, take_rows
from dpfast.ext.loader import LOADED
from dpfast.plan.call_plan import plan_call
from dpfast.trees.binding import Binding

pytestmark = pytest.mark.skipif(not LOADED, reason="the kept call needs the compiled extension")


def _planned(binding, describe, args, kwargs, parts, rank, checked=True, read=None):
    """What DistributedDataParallel.forward keeps of a call planned in full: the KeptCall, or None."""
    plan = plan_call(binding, args, kwargs, parts)
    record = describe(plan, None)
    if plan.mode != "split":
        return None
    share = _share_of(rank, parts, plan.batch_size, tuple(plan.sizes))
    return KeptCall.of(plan, record if checked else None, share, plan.replicas[0][0], read)


def _want(args, kwargs, parts, rank):
    """The full walk's rows of this rank, record and share."""
    full = _full_plan(args, kwargs, parts)
    share = _share_of(rank, parts, full.batch_size, tuple(full.sizes))
    rows = take_rows(full.tree, full.mapped, share.start, share.stop - share.start)
    return rows, describe_step(full, None, False, False), share


@settings(max_examples=60, deadline=None)
@given(st.lists(calls, min_size=2, max_size=10), st.sampled_from([2, 3]), st.integers(0, 2), st.booleans())
def test_a_taken_call_is_the_full_walks_call(sequence, parts, rank, checked):
    """Over a sequence of calls (each four times in a row), every call the kept one takes gives the full walk's
    rows and record, and the kept share; a call it declines is planned in full and kept for the next."""
    rank = min(rank, parts - 1)
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=False)
    kept, taken = None, 0
    for call in [c for c in sequence for _ in range(4)]:
        args, kwargs = _call(*call)
        got = kept.take(binding, args, kwargs) if kept is not None else None
        if got is None:  # planned in full, with what the declining kept call read of it
            kept = _planned(binding, describe, args, kwargs, parts, rank, checked, kept and kept.declined)
            continue
        taken += 1
        rows, record, share = _want(args, kwargs, parts, rank)
        _same_views((got[0], got[1]), rows)
        assert kept.share == share
        if checked:
            assert got[2].items == record.items and got[2].fp == record.fp
        else:
            assert got[2] is None
    # a call whose inputs need no grad, with rows for this rank, is read along its skeleton from its third time in
    # a row (planning keeps a structure seen twice), kept then, and taken the fourth
    if any(not (c[3] and c[2].is_floating_point) and c[0] > rank for c in sequence):
        assert taken > 0


def test_what_is_declined():
    """Each thing the kept call stands for, changed alone, is declined (and planned in full)."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=False)
    base = BASE
    for _ in range(3):
        kept = _planned(binding, describe, *_call(*base), 2, 1)
    assert kept is not None and kept.take(binding, *_call(*base)) is not None
    changes = {**CHANGES, "structure": (4, 3, torch.float32, False, False, True, 1.0)}
    for what, call in changes.items():
        assert kept.take(binding, *_call(*call)) is None, what
    args, kwargs = _call(*base)
    assert kept.take(binding, (args[0].to_sparse(), args[1]), kwargs) is None  # not a plain dense tensor
    assert kept.take(binding, (args[0].to("meta"), args[1]), kwargs) is None  # another device
    assert kept.take(Binding(_forward, IN_DIMS, 0), args, kwargs) is None  # another binding's skeleton


def test_nothing_is_kept_that_needs_a_call_of_its_own():
    """Inputs that require grad (seen through a node made per call) and a rank without rows are never kept."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=False)
    for _ in range(3):
        grad = _planned(binding, describe, *_call(4, 3, torch.float32, True, True, True, 1.0), 2, 0)
    assert grad is None
    for _ in range(3):
        plain = _planned(binding, describe, *_call(1, 3, torch.float32, False, True, True, 1.0), 2, 0)
    assert plain is not None  # rank 0 has the one row
    for _ in range(3):
        empty = _planned(binding, describe, *_call(1, 3, torch.float32, False, True, True, 1.0), 2, 1)
    assert empty is None  # rank 1 has none


def _rnn_forward(x, state, *, mask=None):
    return x


def _rnn_call(batch: int, as_list: bool = False):
    state = [torch.randn(1, batch, 3), torch.randn(1, batch, 3)]
    return (torch.randn(batch, 4), state if as_list else tuple(state)), {"mask": torch.ones(batch, 2)}


def test_a_nested_argument_is_read_along_its_skeleton():
    """An argument made of containers (an LSTM's (h, c), split along dim 1) is read as BoundArguments.again reads
    it: the same rows as the full walk, the very same atoms; a container of another type is declined."""
    binding = Binding(_rnn_forward, {"state": 1}, 0)
    describe = StepDescriber(False, hash_values=False)
    for _ in range(3):
        kept = _planned(binding, describe, *_rnn_call(5), 2, 1)
    assert kept is not None and not kept.skeleton.flat
    args, kwargs = _rnn_call(5)
    got = kept.take(binding, args, kwargs)
    assert got is not None
    full = plan_call(Binding(_rnn_forward, {"state": 1}, 0), args, kwargs, 2)
    share = _share_of(1, 2, full.batch_size, tuple(full.sizes))
    _same_views((got[0], got[1]), take_rows(full.tree, full.mapped, share.start, share.stop - share.start))
    assert type(got[0][1]) is tuple and got[0][1][0].shape == (1, 2, 3)
    assert got[2].fp == describe_step(full, None, False, False).fp
    assert kept.take(binding, *_rnn_call(5, as_list=True)) is None
    assert kept.take(binding, *_rnn_call(6)) is None


def test_per_rank_inputs_are_passed_as_given():
    """inputs="per_rank": a call like the kept one is passed on as given (its very objects), with the full walk's
    record; another row count is declined."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(True, hash_values=False)
    base = (4, 3, torch.float32, False, True, True, 1.0)
    for _ in range(3):
        plan = plan_call(binding, *_call(*base), 1)
        kept = KeptCall.of(plan, describe(plan, None), None, 0)
    assert kept is not None and kept.rows == 4
    args, kwargs = _call(*base)
    got = kept.take(binding, args, kwargs)
    assert got is not None and got[0] is args and got[1] is kwargs
    assert got[2].fp == describe_step(plan_call(Binding(_forward, IN_DIMS, 0), args, kwargs, 1), None, True, False).fp
    assert kept.take(binding, *_call(5, 3, torch.float32, False, True, True, 1.0)) is None


def test_calls_that_never_repeat_stop_being_kept():
    """KeptCalls: calls whose shapes change every time are declined twice, then planned without keeping for 4, 8,
    ... calls (no reading to pay for); once a call repeats it is kept and taken again."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=False)
    kept = KeptCalls()

    def call(batch):
        args, kwargs = _call(batch, 3, torch.float32, False, True, True, 1.0)
        got = kept.take(binding, args, kwargs)
        if got is None:
            plan = plan_call(binding, args, kwargs, 2)
            kept.planned(plan, describe(plan, None), _share_of(0, 2, batch, tuple(plan.sizes)), 0)
        return got is not None

    for b in (4, 4, 4):  # planned twice by the full walk, then along the skeleton: kept
        assert not call(b)
    assert call(4)
    tried = []
    for b in range(5, 25):  # a new B every call
        tried.append(kept.last is not None)
        assert not call(b)
    assert tried[:3] == [True, True, False]  # declined twice in a row: then a pause of 4 calls
    assert tried.count(True) < 8
    for _ in range(70):  # one shape again: kept after the pause, then taken
        call(30)
    assert call(30) and kept.misses == 0


def _variant(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` (a fresh (6, 6, 6, 6) tensor: 6 rows along any axis) changed in one way that planning or the record
    reads, or in none."""
    if how == "same":
        return x.clone()
    if how == "size":
        return torch.randn(6, 6, 6, 7)
    if how == "rows":
        return torch.randn(5, 6, 6, 6)
    if how == "dtype":
        return x.double()
    if how == "grad":
        return x.clone().requires_grad_()
    if how == "strided":  # another memory layout, the same facts: plain all the same
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if how == "meta":
        return x.to("meta")
    if how == "sparse":
        return x.to_sparse()
    if how == "parameter":
        return torch.nn.Parameter(x.clone(), requires_grad=False)
    if how == "subclass":
        return x.clone().as_subclass(_Marked)
    raise AssertionError(how)


class _Marked(torch.Tensor):
    pass


HOW = ["same", "size", "rows", "dtype", "grad", "strided", "channels_last", "meta", "sparse", "parameter", "subclass"]


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0, 1, -1, None]), st.sampled_from(HOW)), min_size=1, max_size=5),
    st.integers(0, 6),
    st.integers(-1, 6),
)
def test_the_one_call_check_reads_as_the_full_reading(leaves, start, length):
    """ops._kept_cut takes a call's tensors exactly when reading them in full (_plain_batch and _tensor_facts)
    gives what the kept call read, and then cuts them as _narrow_many does: the same views, the same objects where
    nothing is cut (length -1: checked only). Every way a tensor can read otherwise, alone or together."""
    from dpfast import ops
    from dpfast.distributed.kept_call import _read

    base = [torch.randn(6, 6, 6, 6) for _ in leaves]
    specs = [spec for spec, _ in leaves]
    kept = _read(base, specs)
    if kept is None:  # (no spec is an int: nothing is split, nothing kept)
        assert all(spec is None for spec in specs)
        return
    tensors = [_variant(x, how) for x, (_, how) in zip(base, leaves)]
    (_, axes, index), facts = kept
    got = ops._kept_cut(tensors, facts, axes, index, start, length)
    reads_alike = _read(tensors, specs) == kept
    rows_inside = length < 0 or start + length <= 6
    assert (got is not None) == (reads_alike and rows_inside), (leaves, got)
    if got is None or length < 0:
        assert got is None or got is True
        return
    want = ops._narrow_many(tensors, axes, start, length)
    for g, w, t in zip(got, want, tensors):
        assert (g is t) == (w is t)
        if g is t:  # passed whole (any tensor: a sparse one too)
            continue
        assert type(g) is type(w) and g.shape == w.shape and g.stride() == w.stride() and torch.equal(g, w)
        if g._base is not None:
            assert g.data_ptr() == w.data_ptr()


def test_a_call_like_the_kept_one_is_taken_without_reading_it_in_full(monkeypatch):
    """A call like the kept one is checked and cut by the one call into the extension: the full reading runs only
    for a call that reads otherwise, and what it read is kept for the planning that follows (``declined``)."""
    import dpfast.distributed.kept_call as kept_call

    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=False)
    for _ in range(3):
        kept = _planned(binding, describe, *_call(*BASE), 2, 1)
    assert kept is not None
    reads = []
    full_read = kept_call._read
    monkeypatch.setattr(kept_call, "_read", lambda *a: reads.append(a) or full_read(*a))
    got = kept.take(binding, *_call(*BASE))
    assert got is not None and reads == []
    args, kwargs = _call(5, 3, torch.float32, False, True, True, 1.0)
    assert kept.take(binding, args, kwargs) is None
    assert len(reads) == 1 and kept.declined == full_read(*reads[0]) and kept.declined[0][0] == 5
