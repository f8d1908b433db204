"""dpfast.trees.facts: what a call's key holds of its leaves. Two leaves get equal facts exactly when every stage
treats them alike (kind, dtype, dims, layout, device type, requires_grad, memory format, nestedness), whatever
their sizes; with the compiled extension the plain tensors' facts are read in one call (4 bytes each), and those
must draw the same lines as Python's own reading (the fallback, which CI runs the suite against too)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dpfast.ext.loader import C
from dpfast.trees.facts import leaf_fact, leaf_facts

needs_extension = pytest.mark.skipif(C is None, reason="the one-call reading is the compiled extension's")


def _tensor(dtype, dims, grad, kind):
    t = torch.zeros([2] * dims, dtype=dtype)
    if kind == "transposed" and dims >= 2:
        t = t.transpose(0, 1)
    elif kind == "channels_last" and dims in (4, 5):
        t = t.contiguous(memory_format=torch.channels_last if dims == 4 else torch.channels_last_3d)
    elif kind == "meta":
        t = t.to("meta")
    elif kind == "parameter":
        t = nn.Parameter(t, requires_grad=False)
    elif kind == "sparse" and dims == 2:
        t = t.to_sparse()
    return t.requires_grad_(grad and (dtype.is_floating_point or dtype.is_complex))


leaves = st.one_of(
    st.builds(
        _tensor,
        st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64, torch.bfloat16]),
        st.integers(0, 6),
        st.booleans(),
        st.sampled_from(["plain", "transposed", "channels_last", "meta", "parameter", "sparse"]),
    ),
    st.sampled_from([None, 3, 2.5, "a", (1, 2), [1, 2]]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(leaves, min_size=1, max_size=8))
def test_equal_facts_exactly_when_python_reads_them_equal(values):
    """Per pair of leaves: the one-call reading says "the same" exactly when Python's leaf_fact does."""
    python = [leaf_fact(v) for v in values]
    if C is None:
        assert leaf_facts(values) == tuple(python)
        return
    codes, others = C._leaf_facts(values)
    mine = [codes[4 * i : 4 * i + 4] if i not in others else ("other", python[i]) for i in range(len(values))]
    for i, j in itertools.combinations(range(len(values)), 2):
        assert (mine[i] == mine[j]) == (python[i] == python[j]), (values[i], values[j], mine[i], mine[j])


@settings(max_examples=100, deadline=None)
@given(st.lists(leaves, min_size=1, max_size=6), st.lists(leaves, min_size=1, max_size=6))
def test_two_calls_share_a_key_exactly_when_their_leaves_share_facts(a, b):
    assert (leaf_facts(a) == leaf_facts(b)) == ([leaf_fact(v) for v in a] == [leaf_fact(v) for v in b])


def test_sizes_are_not_facts():
    """A program serves every batch size: two tensors that differ only in their sizes have the same facts."""
    assert leaf_facts([torch.zeros(3, 4)]) == leaf_facts([torch.zeros(7, 5)])
    assert leaf_facts([torch.zeros(3, 4)]) != leaf_facts([torch.zeros(3, 4, 1)])


@needs_extension
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), min_size=1, max_size=6), st.data())
def test_the_one_call_batch_size_is_pythons(shapes, data):
    """_batch_size: the common size along the given axes (None where they differ), as Tensor.size reads it."""
    tensors = [torch.zeros(rows, width) for rows, width in shapes]
    where = sorted(data.draw(st.sets(st.integers(0, len(tensors) - 1), min_size=1)))
    axes = [data.draw(st.integers(0, 1)) for _ in where]
    sizes = [tensors[i].size(a) for i, a in zip(where, axes)]
    want = sizes[0] if len(set(sizes)) == 1 else None
    assert C._batch_size(tensors, where, axes) == want
