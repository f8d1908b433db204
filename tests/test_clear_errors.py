"""Hostile arguments get a TypeError/ValueError (ScatterError) that names the argument and the fix, never an
internal exception: numpy weights and specs, costs that are sparse or tensor subclasses, an output axis replica 0
lacks, and a batch of graphs whose index tensor no spec can fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import dpfast


class Identity(nn.Module):
    def forward(self, x, y=None):
        return x, y


class WithLengths(nn.Module):
    def forward(self, x, lengths):
        return x


def test_numpy_float_chunk_sizes_are_weights():
    """Before: TypeError 'argument should be a string or a Rational instance' from Fraction."""
    dp = dpfast.DataParallel(nn.Identity(), ["cpu"] * 2, chunk_sizes=[np.float32(1.5), np.float64(1.0)])
    assert dp.plan(torch.zeros(5, 2)).sizes == [3, 2]
    assert dpfast.DataParallel(nn.Identity(), ["cpu"] * 2, chunk_sizes=[np.int64(1), 3]).plan(torch.zeros(8)).sizes == [
        2,
        6,
    ]
    with pytest.raises(ValueError, match=r"chunk_sizes\[1\] is .*inf.*; weights must be finite"):
        dpfast.DataParallel(nn.Identity(), ["cpu"] * 2, chunk_sizes=[1, np.float64("inf")])


def test_a_numpy_array_as_in_dims_says_what_to_give():
    """Before: 'The truth value of an array with more than one element is ambiguous'."""
    with pytest.raises(TypeError, match=r"in_dims must be None, an int, .* \(an array: give in_dims=\[0, 1\]\)"):
        dpfast.DataParallel(Identity(), ["cpu"] * 2, in_dims=np.array([0, 1]))
    with pytest.raises(TypeError, match=r"in_dims\['x'\] is int64 .*0\) \(not a Python int: give int\(...\)\)"):
        dpfast.DataParallel(Identity(), ["cpu"] * 2, in_dims={"x": np.int64(0)})


class Wrapped(torch.Tensor):
    """A wrapper subclass (its data lives in an inner tensor), as tensor subclasses such as DTensor are."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


@pytest.mark.parametrize(
    "costs, what",
    [
        (lambda: torch.tensor([1.0, 2.0, 3.0, 4.0]).to_sparse(), r"a sparse tensor \(layout torch.sparse_coo\)"),
        (lambda: Wrapped(torch.tensor([1.0, 2.0, 3.0, 4.0])), r"a Wrapped \(a tensor subclass\)"),
    ],
    ids=["sparse", "wrapper-subclass"],
)
def test_costs_that_cannot_be_read_name_cost(costs, what):
    """Before: NotImplementedError from the SparseCPU backend / '.tolist() is not supported for tensor subclasses'."""
    dp = dpfast.DataParallel(WithLengths(), ["cpu"] * 2, in_dims={"lengths": None}, cost="lengths")
    for call in (dp.plan, dp):
        with pytest.raises(TypeError, match=rf"cost='lengths' is {what}"):
            call(torch.zeros(4, 2), costs())


def test_an_out_dims_axis_replica_0_lacks_is_worded_for_replica_0():
    """Before: 'replica 0 returned shape (4,), replica 0 (4,)'."""

    class Flat(nn.Module):
        def forward(self, x):
            return x.reshape(-1)

    with pytest.raises(ValueError) as err:
        dpfast.DataParallel(Flat(), ["cpu"] * 2, out_dims=5)(torch.zeros(4, 2))
    assert str(err.value).startswith(
        "output `output` cannot be concatenated along axis 5: replica 0 returned shape (4,), which has no axis 5"
    )


class Graphs(nn.Module):
    """A PyG-style forward: node features, edges as pairs of node indices, each node's graph."""

    def forward(self, x, edge_index, batch):
        return x[edge_index[0]] + x[edge_index[1]]


def test_an_index_tensor_into_the_batch_gets_no_spec_that_cannot_work():
    """Before: the suggested fix was in_dims={'edge_index': None}, which fails on every replica ('index 24 is out of
    bounds'): indices into the batch can be neither split nor replicated."""
    g = torch.Generator().manual_seed(0)
    x, batch = torch.randn(24, 3, generator=g), torch.arange(24) // 6
    edge_index = torch.randint(0, 24, (2, 40), generator=g)
    edge_index[0, 0] = 23
    dp = dpfast.DataParallel(Graphs(), ["cpu"] * 2)
    with pytest.raises(dpfast.ScatterError) as err:
        dp(x, edge_index, batch)
    message = str(err.value)
    assert "edge_index  (2, 40)  0     0     2     <- expected 24; its values index the batch axis" in message
    assert "no in_dims fixes this call: `edge_index` holds indices into the batch axis (values up to 23" in message
    assert "under 'items'" in message and "cost=" in message
    assert "suggested fix" not in message and "'edge_index': None" not in message
    # an integer tensor whose values stay inside every replica's share is still offered None
    with pytest.raises(dpfast.ScatterError, match=r"in_dims=\{'edge_index': None\}"):
        dp(x, edge_index % 12, batch)


def test_a_suggested_fix_keeps_items_next_to_a_bad_leaf():
    """Before: the suggestion turned the argument's 'items' into None."""

    class Batch(nn.Module):
        def forward(self, batch):
            return batch

    images = [torch.zeros(3, 5 + i) for i in range(4)]
    dp = dpfast.DataParallel(Batch(), ["cpu"] * 2, in_dims={"batch": {"images": "items"}})
    with pytest.raises(dpfast.ScatterError, match=r"in_dims=\{'batch': \{'images': 'items', 'h': 1\}\}"):
        dp({"images": images, "h": torch.zeros(1, 4, 2)})


class _PerSample(nn.Module):
    """Scales each sample by its own entry of a Python list: a list of B entries that must be split with ``x``."""

    def forward(self, x, lengths):
        return x * torch.tensor(lengths, dtype=x.dtype).unsqueeze(1)


def test_a_replica_failing_on_a_list_of_b_entries_passed_whole_names_it_and_the_fix():
    """Was: ``The size of tensor a (5) must match the size of tensor b (10)`` from replica 0, naming nothing."""
    x, lengths = torch.ones(10, 2), [float(n) for n in range(10)]
    dp = dpfast.DataParallel(_PerSample(), ["cpu"] * 2)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)replica 0 on cpu raised .*must match.*`lengths` is a list of 10 "
        r"entries, as many as B, passed whole to every replica.*in_dims=\{'lengths': 'items'\}",
    ):
        dp(x, lengths)
    fixed = dpfast.DataParallel(_PerSample(), ["cpu"] * 2, in_dims={"lengths": "items"})  # what it suggests
    torch.testing.assert_close(fixed(x, lengths), _PerSample()(x, lengths))


def test_no_hint_for_a_list_that_is_not_b_long_or_given_none():
    class Fails(nn.Module):
        def forward(self, x, weights):
            raise ValueError("no")

    for in_dims, weights in ((None, [1.0, 2.0]), ({"weights": None}, [1.0] * 4)):
        with pytest.raises(ValueError) as info:
            dpfast.DataParallel(Fails(), ["cpu"] * 2, in_dims=in_dims)(torch.ones(4, 2), weights)
        assert "passed whole" not in str(info.value)


def test_outputs_padded_to_each_chunks_longest_name_the_cause_and_fixes():
    """Was: 'is the batch on another axis? set out_dims for it', while axis 0 already carried the chunk sizes
    (speechbrain's and pytorch-forecasting's LSTMs, flair's CRF)."""

    class PadsToLongest(nn.Module):
        def forward(self, x, lengths):
            longest = int(lengths.max())
            return x[:, :longest]

    x, lengths = torch.randn(4, 6, 5), torch.tensor([6, 5, 3, 2])
    with pytest.raises(
        ValueError,
        match=r"axis 0 carries the batch chunks, but axis 1 differs across replicas "
        r"\(\[6, 3\]\): padded to each chunk's longest sequence\? Pad to a fixed length",
    ):
        dpfast.DataParallel(PadsToLongest(), ["cpu"] * 2)(x, lengths)
