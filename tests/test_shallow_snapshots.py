"""dpfast.run.shallow_snapshots: dicts compared with and restored to snapshots by identity, in one call into the
extension (csrc/python_dicts.cpp) or in Python, with the same result."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast.ext.loader import C
from dpfast.run import shallow_snapshots
from dpfast.run.shallow_snapshots import all_same, restore, same, snap

needs_extension = pytest.mark.skipif(C is None, reason="needs the compiled extension")

# values that are equal but not identical (a change by identity that == would not see), and a tensor, whose ==
# would compare elements
_POOL = [1, 1.0, "a", None, (), [], torch.zeros(2), torch.zeros(2)]

# a mutation of one dict: (kind, key index, value index)
_MUTATION = st.tuples(
    st.sampled_from(["none", "rebind", "rebind same", "add", "delete", "move to end", "equal key", "clear"]),
    st.integers(0, 7),
    st.integers(0, len(_POOL) - 1),
)


def _mutate(d: dict, mutation: tuple) -> bool:
    """Apply ``mutation`` to ``d``; whether ``d`` still holds its entries as they were, by identity."""
    kind, k, v = mutation
    keys = list(d)
    if kind == "none" or (not keys and kind not in ("add", "clear")):
        return True
    key = keys[k % len(keys)] if keys else None
    if kind == "rebind":
        changed = d[key] is not _POOL[v]
        d[key] = _POOL[v]
        return not changed
    if kind == "rebind same":  # the same object again: no change
        d[key] = d[key]
        return True
    if kind == "add":
        d[f"new{k}"] = _POOL[v]  # (no key of a built dict starts with "new")
        return False
    if kind == "delete":
        del d[key]
        return False
    if kind == "move to end":
        value = d.pop(key)
        d[key] = value
        return keys[-1] is key
    if kind == "equal key":  # an equal string, another object: reads as a change
        value = d.pop(key)
        d["".join(list(key))] = value
        return False
    d.clear()
    return not keys


_DICTS = st.lists(
    st.dictionaries(st.sampled_from([f"k{i}" for i in range(8)]), st.integers(0, len(_POOL) - 1), max_size=8).map(
        lambda d: {k: _POOL[v] for k, v in d.items()}
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(dicts=_DICTS, data=st.data())
def test_all_same_tells_what_each_dict_holds(dicts, data):
    snaps = [snap(d) for d in dicts]
    mutations = data.draw(st.lists(_MUTATION, min_size=len(dicts), max_size=len(dicts)))
    unchanged = [_mutate(d, m) for d, m in zip(dicts, mutations)]
    keys, values = [k for k, _ in snaps], [v for _, v in snaps]
    assert all_same(dicts, keys, values) is all(unchanged)
    assert all(map(same, dicts, snaps)) is all(unchanged)
    if C is not None:
        assert C._same_dicts(dicts, keys, values) is all(unchanged)


@settings(max_examples=300, deadline=None)
@given(dicts=_DICTS, data=st.data())
def test_restore_gives_back_every_entry_in_order(dicts, data):
    saved = [dict(d) for d in dicts]
    mutations = data.draw(st.lists(_MUTATION, min_size=len(dicts), max_size=len(dicts)))
    unchanged = [_mutate(d, m) for d, m in zip(dicts, mutations)]
    before = [list(d.items()) for d in dicts]  # what an unchanged dict held: it keeps those very objects
    ids = [id(d) for d in dicts]
    restore(dicts, saved)
    assert [id(d) for d in dicts] == ids  # restored in place
    for d, s, kept, items in zip(dicts, saved, unchanged, before):
        assert same(d, snap(s))
        if kept:
            assert all(a is b and x is y for (a, x), (b, y) in zip(d.items(), items))


@needs_extension
def test_the_extension_and_python_agree(monkeypatch):
    def run():
        lives = [{"a": 1, "b": _POOL[6]}, {"x": "y"}, {}, {"k": 1}]
        saved = [{"b": _POOL[6], "a": 1}, {"x": "y"}, {"z": None}, lives[3]]
        snaps = [snap(d) for d in saved]
        same_before = all_same(lives, [k for k, _ in snaps], [v for _, v in snaps])
        restore(lives, saved)
        return same_before, [list(d.items()) for d in lives]

    fast = run()
    with monkeypatch.context() as m:
        m.setattr(shallow_snapshots, "_fast_same", None)
        m.setattr(shallow_snapshots, "_fast_restore", None)
        python = run()
    assert fast == python == (False, [[("b", _POOL[6]), ("a", 1)], [("x", "y")], [("z", None)], [("k", 1)]])


def test_an_ordered_dict_is_compared_in_its_own_order():
    """An OrderedDict moved to end keeps the dict's storage order underneath: the extension declines it, and the
    comparison follows the OrderedDict's order, as Python iterates it."""
    d = OrderedDict(a=1, b=2, c=3)
    s = snap(d)
    assert all_same([d], [s[0]], [s[1]])
    d.move_to_end("a")
    assert not all_same([d], [s[0]], [s[1]])
    assert all_same([d], [tuple(d)], [tuple(d.values())])
    if C is not None:
        assert C._same_dicts([d], [s[0]], [s[1]]) is NotImplemented
    live = OrderedDict(b=2, a=1)
    restore([live], [OrderedDict(a=1, b=2)])
    assert list(live) == ["a", "b"]


@needs_extension
@pytest.mark.parametrize(
    "args",
    [
        ([{}], [()], [(), ()]),  # lists of different lengths
        ([{"a": 1}], [("a",)], [(1, 2)]),  # a snapshot's keys and values of different lengths
        ([{"a": 1}], [["a"]], [(1,)]),  # not a tuple
        ([{"a": 1}], ("a",), [(1,)]),  # a key that is not a tuple of keys
        (({"a": 1},), [("a",)]),  # too few arguments
        ([{"a": 1}], [("a",)], [(1,)], bytearray(8)),  # too many (a version tag's room: tags are not read)
        ([copy.copy(OrderedDict(a=1))], [("a",)], [(1,)]),
        ((d for d in [{}]), [()], [()]),  # not a list or tuple
    ],
)
def test_same_dicts_declines_what_it_cannot_read(args):
    assert C._same_dicts(*args) is NotImplemented


@needs_extension
@pytest.mark.parametrize(
    "args",
    [
        ([{}], [{}, {}]),
        ([{"a": 1}], [OrderedDict(a=1)]),
        ([OrderedDict(a=1)], [{"a": 1}]),
        ([{"a": 1}], [[("a", 1)]]),
        ([{}],),
    ],
)
def test_restore_dicts_declines_and_changes_nothing(args):
    before = [dict(d) for d in args[0]]
    assert C._restore_dicts(*args) is NotImplemented
    assert [dict(d) for d in args[0]] == before


@pytest.mark.parametrize("fast", [True, False])
def test_restore_of_a_dict_onto_itself_keeps_it(monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(shallow_snapshots, "_fast_restore", None)
    d = {"a": 1}
    restore([d], [d])
    assert d == {"a": 1}


def test_lists_of_different_lengths_are_refused_not_cut_short():
    """Snapshots for fewer dicts than given: the extension declines, and Python refuses rather than compare (or
    restore) only as many as the shortest list."""
    changed = {"a": 2}
    with pytest.raises(ValueError, match="2 dicts for 1 key and 1 value snapshots"):
        all_same([{"a": 1}, changed], [("a",)], [(1,)])
    with pytest.raises(ValueError, match="2 dicts for 1 saved ones"):
        restore([{}, changed], [{"a": 1}])
    assert changed == {"a": 2}
