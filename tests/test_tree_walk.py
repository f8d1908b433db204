"""The walk of argument and output trees (dpfast.trees.specs): no depth limit, cycles and unbounded containers
refused with the path, namedtuples recognised as torch recognises them, dataclass fields that were never set."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import dpfast
from dpfast.trees import walk as tree_specs


class Identity(nn.Module):
    def forward(self, x, y=None):
        return x, y


def _nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


def _innermost(value: Any, depth: int) -> Any:
    """The value inside ``depth`` one-element lists (checking each is one)."""
    for _ in range(depth):
        assert type(value) is list and len(value) == 1
        value = value[0]
    return value


def _dp(n: int = 2, **kwargs) -> dpfast.DataParallel:
    return dpfast.DataParallel(Identity(), ["cpu"] * n, **kwargs)


@pytest.mark.parametrize("depth", [400, 1000, 5000])
def test_deep_nesting_round_trips(depth):
    """torch's scatter recurses (about 990 levels); the walks here do not, so any depth splits and comes back."""
    x = torch.arange(12.0).reshape(6, 2)
    value = _nested(x, depth)
    dp = _dp(3)
    assert dp.plan(value, None).sizes == [2, 2, 2]
    out, _ = dp(value, None)
    assert torch.equal(_innermost(out, depth), x)


def test_a_deep_leaf_path_is_linear_in_depth():
    depth = 20_000
    plan = _dp().plan(_nested(torch.zeros(4, 2), depth), None)
    (leaf,) = [leaf for leaf in plan.tree.leaves if leaf.value is not None]
    assert leaf.path == "x" + "[0]" * depth


@pytest.mark.parametrize("where", ["list", "dict", "tuple_in_dict"])
def test_a_container_that_contains_itself_is_an_error_naming_where_the_cycle_closes(where):
    x = torch.zeros(4, 2)
    if where == "list":
        value: Any = [x]
        value.append(value)
        path = "x[1]"
    elif where == "dict":
        value = {"a": x}
        value["me"] = value
        path = "x['me']"
    else:
        inner: dict = {"a": x}
        value = {"p": (x, inner)}
        inner["back"] = value
        path = "x['p'][1]['back']"
    dp = _dp()
    for call in (dp.plan, dp):
        with pytest.raises(ValueError, match=rf"`{re.escape(path)}` is a \w+ that contains itself"):
            call(value, None)


def test_a_shared_container_is_no_cycle():
    x = torch.arange(8.0).reshape(4, 2)
    inner = [x]
    out, _ = _dp()([inner, inner], None)
    assert len(out) == 2 and all(type(o) is list and len(o) == 1 and torch.equal(o[0], x) for o in out)


def test_a_cyclic_output_is_an_error_naming_the_output_path():
    class Loop(nn.Module):
        def forward(self, x):
            out = [x]
            out.append(out)
            return out

    with pytest.raises(ValueError, match=r"`output\[1\]` is a list that contains itself"):
        dpfast.DataParallel(Loop(), ["cpu"] * 2, out_dims=None)(torch.zeros(4, 2))


def test_a_spec_that_contains_itself_is_refused_at_construction():
    spec: list = [0]
    spec.append(spec)
    with pytest.raises(ValueError, match=r"in_dims\['x'\]\[1\] contains itself"):
        _dp(in_dims={"x": spec})


class LooksNamed(tuple):
    """Not a namedtuple: it has ``_fields`` (naming one of its two elements) but no ``_make``/``_asdict``."""

    _fields = ("a",)


class Point(NamedTuple):
    a: Any
    b: Any


def test_a_tuple_with_fields_that_is_no_namedtuple_round_trips_as_a_tuple():
    """Before: its second element was lost and the first came back as 6 zero-dim tensors."""
    t = LooksNamed((torch.arange(6.0), torch.arange(6.0) + 10))
    out, _ = _dp(3)(t, None)
    assert type(out) is LooksNamed and len(out) == 2
    assert torch.equal(out[0], t[0]) and torch.equal(out[1], t[1])


def test_namedtuples_are_recognised_as_torch_recognises_them():
    p = Point(torch.zeros(4, 3), torch.ones(2, 4))
    dp = _dp(in_dims={"x": {"b": 1}}, out_dims=({"b": 1}, None))  # a dict spec names a namedtuple's fields
    out, _ = dp(p, None)
    assert type(out) is Point and torch.equal(out.a, p.a) and torch.equal(out.b, p.b)
    r = torch.max(torch.arange(12.0).reshape(4, 3), 1)  # torch.return_types: a structseq, a tuple by position
    out, _ = _dp()(r, None)
    assert type(out) is type(r) and torch.equal(out.values, r.values) and torch.equal(out.indices, r.indices)


@dataclasses.dataclass
class Later:
    x: torch.Tensor
    cache: Any = dataclasses.field(init=False)  # set later, or never


def test_a_dataclass_field_never_set_is_no_child():
    """Before: AttributeError from the walk."""
    v = Later(torch.arange(8.0).reshape(4, 2))
    dp = _dp()
    assert "x.x" in str(dp.plan(v, None))
    out, _ = dp(v, None)
    assert type(out) is Later and torch.equal(out.x, v.x) and not hasattr(out, "cache")
    with pytest.raises(ValueError, match=r"in_dims for `x` names \['cache'\], which `x` does not have"):
        _dp(in_dims={"x": {"cache": None}})(v, None)
    v.cache = [1, 2]
    out, _ = dp(v, None)
    assert out.cache == [1, 2]


class Endless(Mapping):
    """A Mapping whose iteration never ends."""

    def __init__(self, length: int):
        self.length = length

    def __getitem__(self, key):
        return torch.zeros(4, 2)

    def __len__(self):
        return self.length

    def __iter__(self):
        return (f"k{i}" for i in itertools.count())


def test_a_mapping_whose_iteration_never_ends_is_refused_promptly():
    """Before: plan() walked it while memory grew. Its len() bounds the walk (and the walk's budget bounds len())."""
    dp = _dp()
    for call in (dp.plan, dp):
        with pytest.raises(ValueError, match=r"`x` is a Endless whose items go on past its len\(\) \(2\)"):
            call(Endless(2), None)
    with pytest.raises(ValueError, match=r"`x` \(Endless of 1,000,000,000,000 values\) takes the walk past"):
        dp.plan(Endless(10**12), None)


def test_a_walk_reads_a_bounded_number_of_values(monkeypatch):
    """A tree with more values than MAX_VALUES (say a list shared at every level, 2**40 leaves) is refused, not
    walked; the budget spans the call's arguments."""
    monkeypatch.setattr(tree_specs, "MAX_VALUES", 1000)
    x = torch.zeros(4, 2)
    shared: Any = [x]
    for _ in range(40):
        shared = [shared, shared]
    dp = _dp()
    with pytest.raises(ValueError, match=r"takes the walk past 1,000 values \(leaves and containers\)"):
        dp.plan(shared, None)
    with pytest.raises(ValueError, match=r"`y` \(list of 600 values\) takes the walk past 1,000"):
        dp.plan([x] * 600, [x] * 600)

    class Deep(nn.Module):
        def forward(self, x):
            return _nested(x, 1200)

    with pytest.raises(ValueError, match=r"takes the walk past 1,000 values .* from a call's outputs"):
        dpfast.DataParallel(Deep(), ["cpu"] * 2)(x)


def test_a_long_list_of_numbers_is_one_leaf_passed_by_reference():
    """Before: a list of 10**7 ints was walked leaf by leaf for minutes (2.4 GB). A list, tuple or dict of plain
    numbers and strings holds no tensor: under None or the default spec it is one leaf, whatever its length."""

    class Takes(nn.Module):
        def forward(self, x, ids):
            assert ids is expected
            return x

    expected = ids = list(range(3 * tree_specs.MAX_VALUES))
    dp = dpfast.DataParallel(Takes(), ["cpu"] * 2)
    plan = dp.plan(torch.zeros(4, 2), ids)
    assert len(plan.tree.leaves) == 2 and plan.tree.leaves[1].value is ids
    assert "ids   list[3000000]  0     by reference" in str(plan)
    assert torch.equal(dp(torch.zeros(4, 2), ids), torch.zeros(4, 2))
    with pytest.raises(TypeError, match=r"in_dims gives `ids\[0\]` the batch axis 0, but it is an int"):
        dpfast.DataParallel(Takes(), ["cpu"] * 2, in_dims={"ids": 0})(torch.zeros(4, 2), [1, 2, 3, 4])


def test_replicas_returning_different_structures_name_the_path():
    class Ragged(nn.Module):
        def forward(self, x):
            return {"a": [x] * (2 if x.shape[0] > 1 else 1)}

    different = r"replica 0 returned a list of length 2, replica 1 returned a list of length 1 at `output\['a'\]`"
    with pytest.raises(ValueError, match=different):
        dpfast.DataParallel(Ragged(), ["cpu"] * 2)(torch.zeros(3, 2))
