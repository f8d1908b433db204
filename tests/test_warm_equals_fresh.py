"""A warmed wrapper equals a fresh one: random sequences of calls (shapes, dtypes, specs, structures, device
counts, settings changed between calls by assignment and in place) through one ``DataParallel``, and through one
binding as ``DistributedDataParallel`` plans, cuts and records them in both input modes, each call compared with
what a fresh wrapper (or binding) does with it: the same outputs bit for bit, the same plan, every rank's same
rows and the same step record, or the same error. The gloo scenario of the same on 2 and 3 ranks is in
test_distributed_warm_equals_fresh.py."""

from __future__ import annotations

import copy
import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dpfast
from dpfast.distributed.agreement import step_record
from dpfast.distributed.inputs import cut_rows
from dpfast.plan.call_plan import plan_call
from dpfast.trees.binding import Binding

from dp_testing import assert_same_bits


class Echo(nn.Module):
    """Its inputs back, floating-point ones doubled (a replica that moved anything wrongly shows it)."""

    def forward(self, x, state=None, *, mask=None, tag=None):
        out = {"x": x * 2 if x.is_floating_point() else x}
        if state is not None:
            out["state"] = tuple(s * 2 if s.is_floating_point() else s for s in state)
        if mask is not None:
            out["mask"] = mask
        if tag is not None:
            out["tag"] = tag
        return out


def _call(batch: int, width: int, dtype: torch.dtype, layout: str, with_state: bool, mask: bool, tag: object):
    """One call's (args, kwargs): ``x`` (B, width) or channels_last (B, 3, 2, 2); an RNN-like state (L, B, H) pair;
    a mask passed whole; an atom passed by reference."""
    g = torch.Generator().manual_seed(batch * 31 + width)
    if layout == "channels_last":
        x = torch.randn(batch, 3, 2, 2, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    else:
        x = torch.randn(batch, width, generator=g).to(dtype)
        x = x.t().contiguous().t() if layout == "transposed" and batch > 1 else x
    args: tuple = (x,)
    if with_state:
        args += ((torch.randn(2, batch, 3, generator=g), torch.randn(2, batch, 3, generator=g)),)
    kwargs: dict = {"tag": tag}
    if mask:
        kwargs["mask"] = torch.ones(5, 5)
    return args, kwargs


calls = st.tuples(
    st.integers(0, 7),  # B
    st.integers(1, 4),  # width
    st.sampled_from([torch.float32, torch.float64, torch.int64]),
    st.sampled_from(["plain", "transposed", "channels_last"]),
    st.booleans(),  # an RNN state
    st.booleans(),  # a mask
    st.sampled_from([None, 1, 2.5, "a", (1, 2)]),
)
# settings changed between calls: by assignment, or in place (the in_dims dict itself)
changes = st.sampled_from(["none", "devices", "dim", "in_dims", "in_dims in place", "out_dims", "chunk_sizes"])

IN_DIMS = {"state": 1, "mask": None}
OUT_DIMS = {"state": 1, "mask": None, "tag": None}


def _change(dp: dpfast.DataParallel, kwargs: dict, change: str, step: int) -> dict:
    """Apply ``change`` to ``dp`` and return the constructor keywords a fresh wrapper needs to match it."""
    n = 1 + step % 3
    if change == "devices":
        dp.chunk_sizes = None  # (first: weights for another device count are refused)
        dp.device_ids = ["cpu"] * n
        kwargs.update(device_ids=["cpu"] * n, chunk_sizes=None)
    elif change == "dim":
        dp.dim = -1 if dp.dim == 0 else 0
        kwargs["dim"] = dp.dim
    elif change == "in_dims":
        dp.in_dims = {"state": 1} if dp.in_dims == IN_DIMS else dict(IN_DIMS)
        kwargs["in_dims"] = copy.deepcopy(dp.in_dims)
    elif change == "in_dims in place":
        dp.in_dims["mask"] = 0 if dp.in_dims.get("mask", 0) is None else None
        kwargs["in_dims"] = copy.deepcopy(dp.in_dims)
    elif change == "out_dims":
        dp.out_dims = None if dp.out_dims is not None else dict(OUT_DIMS)
        kwargs["out_dims"] = copy.deepcopy(dp.out_dims)
    elif change == "chunk_sizes":
        dp.chunk_sizes = [1 + k for k in range(len(dp.device_ids))]
        kwargs["chunk_sizes"] = list(dp.chunk_sizes)
    return kwargs


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - compared with the fresh wrapper's
        return ("raised", type(exc), str(exc))


def _planned_call(dp: dpfast.DataParallel, args: tuple, kwargs: dict) -> tuple:
    return str(dp.plan(*args, **kwargs)), dp(*args, **kwargs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(calls, changes), min_size=2, max_size=10))
def test_a_warmed_data_parallel_is_a_fresh_one(sequence):
    kwargs: dict = dict(device_ids=["cpu"] * 2, in_dims=dict(IN_DIMS), out_dims=dict(OUT_DIMS))
    dp = dpfast.DataParallel(Echo(), **copy.deepcopy(kwargs))
    for step, (call, change) in enumerate([(c, ch) for c, ch in sequence for _ in range(2)]):
        kwargs = _change(dp, kwargs, change, step)
        args, kw = _call(*call)
        fresh = dpfast.DataParallel(Echo(), **copy.deepcopy(kwargs))
        got, want = (_outcome(functools.partial(_planned_call, w, args, kw)) for w in (dp, fresh))
        assert got[0] == want[0], (step, got, want)
        if got[0] == "ok":
            assert got[1][0] == want[1][0], step
            assert_same_bits(got[1][1], want[1][1])
        else:
            assert got[1:] == want[1:], step


def _forward(x, state=None, *, mask=None, tag=None):
    return x


@settings(max_examples=60, deadline=None)
@given(st.lists(calls, min_size=2, max_size=10), st.sampled_from([2, 3]), st.booleans())
def test_a_warmed_binding_plans_cuts_and_records_as_a_fresh_one(sequence, world, per_rank):
    """DistributedDataParallel's side of a call, without a process group: the plan over the ranks (one part for
    per-rank inputs), every rank's rows, and the step record, of a binding warmed by the calls before, equal a fresh
    binding's."""
    binding = Binding(_forward, IN_DIMS, 0)
    parts = 1 if per_rank else world
    for call in [c for c in sequence for _ in range(2)]:
        args, kwargs = _call(*call)
        got = _outcome(functools.partial(plan_call, binding, args, kwargs, parts))
        want = _outcome(functools.partial(plan_call, Binding(_forward, IN_DIMS, 0), args, kwargs, parts))
        assert got[0] == want[0], (got, want)
        if got[0] == "raised":
            assert got[1:] == want[1:]
            continue
        mine, theirs = got[1], want[1]
        assert (mine.mode, mine.batch_size, mine.sizes) == (theirs.mode, theirs.batch_size, theirs.sizes)
        a, b = step_record(mine, per_rank), step_record(theirs, per_rank)
        assert (a.fp, a.items) == (b.fp, b.items)
        if mine.mode == "split":
            for part in range(parts):
                start, stop = mine.share(part)
                assert_same_bits(cut_rows(mine, start, stop - start), cut_rows(theirs, start, stop - start))
