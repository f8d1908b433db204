"""What DistributedDataParallel's checks compare, for calls planned by a program: the step record (its fingerprint
from the program's and what the call adds, dpfast.distributed.agreement.step_record) and this rank's rows
(dpfast.distributed.inputs.cut_rows). Both must be what a fresh binding gives: two calls get the same fingerprint
exactly when their descriptions are the same, whatever the calls before them. Planned without a process group (the
planning stage is the same)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast.distributed.agreement import describe_step, step_record
from dpfast.distributed.group import RankGroup
from dpfast.distributed.inputs import cut_rows, through_input_grads
from dpfast.plan.call_plan import plan_call
from dpfast.trees.binding import Binding


def _forward(x, h=None, *, mask=None, scale=1.0):
    return x


IN_DIMS = {"h": 1, "mask": None}


def _call(batch: int, width: int, dtype: torch.dtype, grad: bool, with_h: bool, mask: bool, scale: object):
    x = torch.randn(batch, width).to(dtype).requires_grad_(grad and dtype.is_floating_point)
    args: tuple = (x, torch.randn(2, batch, 3)) if with_h else (x,)
    kwargs: dict = {"scale": scale}
    if mask:
        kwargs["mask"] = torch.ones(batch, dtype=torch.bool)
    return args, kwargs


calls = st.tuples(
    st.integers(1, 9),  # B
    st.integers(1, 4),  # width
    st.sampled_from([torch.float32, torch.float64, torch.int64]),
    st.booleans(),  # requires_grad
    st.booleans(),  # h given
    st.booleans(),  # mask given
    st.sampled_from([1.0, 2, None]),  # an atom of another type
)


def _full_plan(args, kwargs, parts):
    """The plan a fresh binding makes (its program compiled for this call)."""
    binding = Binding(_forward, IN_DIMS, 0)
    plan = plan_call(binding, args, kwargs, parts)
    assert binding.programs.compiled == 1
    return plan


@settings(max_examples=60, deadline=None)
@given(st.lists(calls, min_size=3, max_size=12), st.sampled_from([2, 3]), st.booleans())
def test_a_programs_record_is_a_fresh_bindings(sequence, parts, per_rank):
    """A warmed binding's record (items and fingerprint) equals a fresh binding's, call by call; and two calls share
    a fingerprint exactly when they share a description (what the ranks compare)."""
    binding = Binding(_forward, IN_DIMS, 0)
    seen: dict[int, dict] = {}
    for call in [c for c in sequence for _ in range(3)] * 2:
        args, kwargs = _call(*call)
        got = step_record(plan_call(binding, args, kwargs, parts), per_rank)
        want = step_record(_full_plan(args, kwargs, parts), per_rank)
        assert got.fp == want.fp and got.status == want.status
        items = describe_step(_full_plan(args, kwargs, parts), None, per_rank, False).items
        assert got.items == items
        assert seen.setdefault(got.fp, items) == items, "two descriptions, one fingerprint"
    assert len(seen) == len({repr(i) for i in seen.values()})
    assert binding.programs.compiled < 3 * len(sequence)  # (calls of a key seen before ran its program)


BASE = (4, 3, torch.float32, False, True, True, 1.0)  # a call of _call, and each thing about it changed alone
CHANGES = {
    "B": (6, 3, torch.float32, False, True, True, 1.0),
    "shape": (4, 5, torch.float32, False, True, True, 1.0),
    "dtype": (4, 3, torch.float64, False, True, True, 1.0),
    "requires_grad": (4, 3, torch.float32, True, True, True, 1.0),
    "atom type": (4, 3, torch.float32, False, True, True, 2),
    "an argument fewer": (4, 3, torch.float32, False, False, True, 1.0),
    "a keyword fewer": (4, 3, torch.float32, False, True, False, 1.0),
}


@pytest.mark.parametrize("per_rank", [False, True])
def test_a_changed_leaf_changes_the_record(per_rank):
    """Each thing a record says about a leaf, changed alone, gives another fingerprint (per-rank inputs: all but
    the sizes)."""
    binding = Binding(_forward, IN_DIMS, 0)
    first = step_record(plan_call(binding, *_call(*BASE), 2), per_rank)
    for what, call in CHANGES.items():
        for _ in range(2):  # compiled, then run by its program
            record = step_record(plan_call(binding, *_call(*call), 2), per_rank)
        if per_rank and what in ("B", "shape"):
            assert record.fp == first.fp, what
        else:
            assert record.fp != first.fp, what
        assert step_record(plan_call(binding, *_call(*BASE), 2), per_rank).fp == first.fp, what


def test_values_hashing_describes_every_call():
    """check_batch="values" hashes the split tensors' bytes: every call is described afresh."""
    binding = Binding(_forward, IN_DIMS, 0)
    fps = set()
    for _ in range(4):
        args, kwargs = _call(4, 3, torch.float32, False, False, False, 1.0)
        fps.add(describe_step(plan_call(binding, args, kwargs, 2), None, False, True).fp)
    assert len(fps) == 4  # randn: other bytes every call


def _same_views(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a._is_view() == b._is_view()
        if a._is_view():  # a view of the same input (a batch axis other than 0 is a contiguous copy)
            assert a.data_ptr() == b.data_ptr() or a.numel() == 0
        assert a.requires_grad == b.requires_grad and (a.grad_fn is None) == (b.grad_fn is None)
        assert torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_views(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_views(a[k], b[k])
    else:
        assert a == b


def _narrowed_by_hand(args, kwargs, start, length):
    """The rows of ``_call``'s arguments as Tensor.narrow cuts them: x along 0 (a view), h along 1 (contiguous)."""
    x = args[0].narrow(0, start, length)
    rest = (args[1].narrow(1, start, length).contiguous(),) if len(args) > 1 else ()
    return (x, *rest), kwargs


@settings(max_examples=40, deadline=None)
@given(calls, st.sampled_from([2, 3]), st.booleans())
def test_every_ranks_rows_are_tensor_narrows(call, parts, grads):
    """Every rank's rows (an empty share too), cut by a warmed binding's program: the views a fresh binding cuts,
    and Tensor.narrow's, with the input-gradient node's views in place."""
    binding = Binding(_forward, IN_DIMS, 0)
    args, kwargs = _call(*call)
    for _ in range(3):
        plan = plan_call(binding, args, kwargs, parts)
    full = _full_plan(args, kwargs, parts)
    group = RankGroup(None, 0, parts, torch.device("cpu"))
    for rank in range(parts):
        start, stop = plan.share(rank)
        if grads:
            subs = through_input_grads(plan.tree, group, False)
            assert list(through_input_grads(full.tree, group, False)) == list(subs)
        else:
            subs = {}
        got = cut_rows(plan, start, stop - start, subs)
        _same_views(got, cut_rows(full, start, stop - start, subs))
        if not subs:
            _same_views(got, _narrowed_by_hand(args, kwargs, start, stop - start))


class _TorchFunctionLog(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.narrows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.narrows += func is torch.Tensor.narrow
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_every_narrow():
    binding = Binding(_forward, IN_DIMS, 0)
    args, kwargs = _call(6, 3, torch.float32, False, True, True, 1.0)
    for _ in range(3):
        plan = plan_call(binding, args, kwargs, 2)
    want = cut_rows(plan, 3, 3)
    with _TorchFunctionLog() as log:
        got = cut_rows(plan, 3, 3)
    assert log.narrows == 2  # x and h (the mask is passed whole)
    _same_views(got, want)


def _with_whole(x, extra):
    return x


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_passed_whole():
    """A strided nested tensor passed whole beside a split tensor: described and cut by the program as a fresh
    binding describes and cuts it, at every call."""
    binding = Binding(_with_whole, {"extra": None}, 0)
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    x = torch.randn(4, 2)
    for _ in range(4):
        plan = plan_call(binding, (x, nested), {}, 2)
        got = step_record(plan, False)
        fresh = plan_call(Binding(_with_whole, {"extra": None}, 0), (x, nested), {}, 2)
        want = step_record(fresh, False)
        assert (got.status, got.items, got.fp) == (want.status, want.items, want.fp)
        rows = cut_rows(plan, 2, 2)
        _same_views(rows[0][0], x[2:4])
        assert rows[0][1] is nested
    assert binding.programs.compiled == 1
