"""What DistributedDataParallel's checks compare, for calls read along a kept skeleton: the step record
(dpfast.distributed.agreement.StepDescriber keeps it by what its texts are made of) and this rank's rows
(dpfast.distributed.sharding.cut_rows cuts them from planning's marks). Both must be exactly what the full walk
gives: a kept record is never served for a call whose shapes, dtypes, requires_grad, split or structure differ.
Planned without a process group (the planning stage is the same), against a fresh Binding that walks in full."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast import ops
from dpfast.distributed.agreement import StepDescriber, _tensor_facts, describe_step
from dpfast.distributed.exchanges import RankGroup, through_input_grads
from dpfast.distributed.sharding import _narrowed, cut_rows, take_rows
from dpfast.ext.loader import LOADED
from dpfast.plan.call_plan import plan_call
from dpfast.trees.binding import Binding

pytestmark = pytest.mark.skipif(not LOADED, reason="the skeleton path needs the compiled extension")


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
    """The plan a fresh binding makes: the full walk, one Leaf record per leaf."""
    plan = plan_call(Binding(_forward, IN_DIMS, 0), args, kwargs, parts)
    assert plan.tree.flat is None
    return plan


@settings(max_examples=60, deadline=None)
@given(st.lists(calls, min_size=3, max_size=12), st.sampled_from([2, 3]), st.booleans())
def test_a_kept_record_is_the_full_walks_record(sequence, parts, per_rank):
    """A warmed describer's record (items and fingerprint) equals describe_step of the full walk, call by call."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(per_rank, hash_values=False)
    read_along = 0
    # each call 3 times (a structure seen twice in a row is read along its skeleton after), and the whole sequence
    # again (records kept)
    for call in [c for c in sequence for _ in range(3)] * 2:
        args, kwargs = _call(*call)
        plan = plan_call(binding, args, kwargs, parts)
        read_along += plan.tree.flat is not None
        got = describe(plan, None)
        want = describe_step(_full_plan(args, kwargs, parts), None, per_rank, False)
        assert got.items == want.items
        assert got.fp == want.fp
        assert got.status == want.status
    assert read_along > 0  # the skeleton path was taken


BASE = (4, 3, torch.float32, False, True, True, 1.0)  # a call of _call, and each thing about it changed alone
CHANGES = {
    "B": (6, 3, torch.float32, False, True, True, 1.0),
    "shape": (4, 5, torch.float32, False, True, True, 1.0),
    "dtype": (4, 3, torch.float64, False, True, True, 1.0),
    "requires_grad": (4, 3, torch.float32, True, True, True, 1.0),
    "atom type": (4, 3, torch.float32, False, True, True, 2),
}


def test_a_changed_leaf_changes_the_record():
    """Each thing a record says about a leaf, changed alone, gives another fingerprint (the kept key has it)."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=False)
    base, changes = BASE, CHANGES
    for _ in range(3):
        plan = plan_call(binding, *_call(*base), 2)
        first = describe(plan, None)
    assert plan.tree.flat is not None
    for what, call in changes.items():
        for _ in range(3):  # kept, then read along the same skeleton
            plan = plan_call(binding, *_call(*call), 2)
            record = describe(plan, None)
        assert plan.tree.flat is not None, what
        assert record.fp != first.fp, what
        plan = plan_call(binding, *_call(*base), 2)
        assert describe(plan, None).fp == first.fp, what


def test_values_hashing_is_never_kept():
    """check_batch="values" hashes the split tensors' bytes: every call is described afresh."""
    binding = Binding(_forward, IN_DIMS, 0)
    describe = StepDescriber(False, hash_values=True)
    fps = set()
    for _ in range(4):
        args, kwargs = _call(4, 3, torch.float32, False, False, False, 1.0)
        fps.add(describe(plan_call(binding, args, kwargs, 2), None).fp)
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


@settings(max_examples=40, deadline=None)
@given(calls, st.sampled_from([2, 3]), st.booleans())
def test_cut_rows_along_a_skeleton_equals_take_rows(call, parts, grads):
    """Every rank's rows (an empty share too) from planning's marks: the same views take_rows makes from the Leaf
    records of the full walk, with the input-gradient node's views in place."""
    binding = Binding(_forward, IN_DIMS, 0)
    args, kwargs = _call(*call)
    for _ in range(3):
        plan = plan_call(binding, args, kwargs, parts)
    assert plan.tree.flat is not None
    full = _full_plan(args, kwargs, parts)
    group = RankGroup(None, 0, parts, torch.device("cpu"))
    for rank in range(parts):
        start, stop = plan.share(rank)
        if grads:
            subs = through_input_grads(plan.tree, group, False)
            full_subs = {i: subs[i] for i in through_input_grads(full.tree, group, False)}
            assert list(full_subs) == list(subs)
        else:
            subs = full_subs = {}
        got = cut_rows(plan, start, stop - start, subs)
        want = take_rows(full.tree, full.mapped, start, stop - start, full_subs)
        _same_views(got, want)


tensor_cuts = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=3),  # shape
        st.sampled_from([torch.float32, torch.float64, torch.int64]),
        st.booleans(),  # requires_grad (floating point only)
        st.booleans(),  # cut (else axis -1: passed as it is)
        st.booleans(),  # a transposed (non-contiguous) input
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=80, deadline=None)
@given(tensor_cuts, st.data())
def test_narrow_many_equals_tensor_narrow(leaves, data):
    """The extension's one-call cut (ops._narrow_many) is each tensor's Tensor.narrow, a view along axis 0 and a
    contiguous copy along another, with the same values, strides, storage and gradients; uncut tensors come back
    as the very same objects."""
    tensors, axes = [], []
    for shape, dtype, grad, cut, transposed in leaves:
        t = torch.randn(shape[::-1]).to(dtype).permute(*reversed(range(len(shape)))) if transposed else None
        t = t if t is not None else torch.randn(shape).to(dtype)
        tensors.append(t.requires_grad_(grad and dtype.is_floating_point))
        axes.append(data.draw(st.integers(0, len(shape) - 1)) if cut else -1)
    cut_sizes = [t.shape[a] for t, a in zip(tensors, axes) if a >= 0]
    limit = min(cut_sizes, default=5)
    start = data.draw(st.integers(0, limit))
    length = data.draw(st.integers(0, limit - start))
    got = ops._narrow_many(tensors, axes, start, length)
    assert got is not None
    want = [_narrowed(t, a, start, length) if a >= 0 else t for t, a in zip(tensors, axes)]
    for g, w, t, a in zip(got, want, tensors, axes):
        if a < 0:
            assert g is t
            continue
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype and torch.equal(g, w)
        assert g._is_view() == w._is_view() and (not g._is_view() or g.data_ptr() == w.data_ptr() or g.numel() == 0)
        assert g.requires_grad == w.requires_grad and (g.grad_fn is None) == (w.grad_fn is None)
    grads = [t for t, a in zip(tensors, axes) if a >= 0 and t.requires_grad]
    if grads:
        weights = [torch.randn(w.shape).to(w.dtype) for w in want]
        cut = [(g, w) for g, w, t, a in zip(got, weights, tensors, axes) if a >= 0 and t.requires_grad]
        mine = torch.autograd.grad(sum((g * w).sum() for g, w in cut), grads)
        cut = [(v, w) for v, w, t, a in zip(want, weights, tensors, axes) if a >= 0 and t.requires_grad]
        theirs = torch.autograd.grad(sum((v * w).sum() for v, w in cut), grads)
        for m, t in zip(mine, theirs):
            assert torch.equal(m, t)


def test_narrow_many_declines_what_python_must_narrow():
    """Anything unusual goes back to Python's narrows, which raise torch's own error for rows out of range."""
    x = torch.randn(6, 4)
    for args in (
        ([x], [0], 4, 3),  # past the end
        ([x], [0], 2**62, 2**62),  # start + length overflows int64
        ([x], [0], -1, 2),
        ([x], [2], 0, 1),  # no such axis
        ([x], [-2], 0, 1),  # only -1 means "as it is"
        ([x.to_sparse()], [0], 0, 1),
        ([x.tolist()], [0], 0, 1),  # no tensor at all
        ([x], [0], True, 1),  # a bool is not a row
        ([x, x], [0], 0, 1),  # one axis per tensor
    ):
        assert ops._narrow_many(*args) is None, args


class _TorchFunctionLog(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.narrows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.narrows += func is torch.Tensor.narrow
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_every_narrow():
    """Under a __torch_function__ mode the one-call cut declines, and the mode sees each tensor's narrow."""
    binding = Binding(_forward, IN_DIMS, 0)
    args, kwargs = _call(6, 3, torch.float32, False, True, True, 1.0)
    for _ in range(3):
        plan = plan_call(binding, args, kwargs, 2)
    assert plan.tree.flat is not None
    want = cut_rows(plan, 3, 3)
    with _TorchFunctionLog() as log:
        got = cut_rows(plan, 3, 3)
    assert log.narrows == 2  # x and h (the mask is passed whole)
    _same_views(got, want)


def _with_whole(x, extra):
    return x


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_passed_whole_is_described_by_the_full_walk():
    """A strided nested tensor has no sizes to key a record by: a call that passes one whole beside a split tensor
    is described by the full walk at every call (it raised an internal error at the third), as a fresh describer
    describes it."""
    binding = Binding(_with_whole, {"extra": None}, 0)
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    x = torch.randn(4, 2)
    describer = StepDescriber(False, False)
    for call in range(4):
        plan = plan_call(binding, (x, nested), {}, 2)
        assert (plan.tree.flat is not None) == (call >= 2)  # read along the kept skeleton from the third call
        got = describer(plan, None)
        fresh = plan_call(Binding(_with_whole, {"extra": None}, 0), (x, nested), {}, 2)
        want = describe_step(fresh, None, False, False)
        assert (got.status, got.items, got.fp) == (want.status, want.items, want.fp)
        rows = cut_rows(plan, 2, 2)  # the nested tensor passes whole, as the full walk's take_rows passes it
        _same_views(rows[0][0], take_rows(fresh.tree, fresh.mapped, 2, 2)[0][0])
        assert rows[0][1] is nested


def _python_facts(tensors):
    out = []
    for v in tensors:
        out += [*v.shape, v.dtype, v.requires_grad]
    return tuple(out)


@settings(max_examples=60, deadline=None)
@given(tensor_cuts)
def test_tensor_facts_are_pythons(leaves):
    """The extension's facts (the key of a kept step record) are the very objects Python reads: each tensor's
    sizes, dtype and requires_grad; under a __torch_function__ mode it declines and Python reads them."""
    tensors = []
    for shape, dtype, grad, sparse, transposed in leaves:
        t = torch.randn(shape).to(dtype)
        t = t.t() if transposed and t.dim() == 2 else t
        t = t.to_sparse() if sparse and t.dim() == 2 and not grad else t
        tensors.append(t.requires_grad_(grad and dtype.is_floating_point))
    got = ops._tensor_facts(tensors)
    assert got == _python_facts(tensors)
    assert [type(v) for v in got] == [type(v) for v in _python_facts(tensors)]
    with _TorchFunctionLog():
        assert ops._tensor_facts(tensors) is None
        assert _tensor_facts(tensors, range(len(tensors))) == _python_facts(tensors)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tensor_facts_decline_a_nested_tensor():
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    assert ops._tensor_facts([torch.randn(2), nested]) is None
    assert _tensor_facts([torch.randn(2), nested], [0, 1]) is None
    assert _tensor_facts([torch.randn(2), nested], [0]) == (2, torch.float32, False)
