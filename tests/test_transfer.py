"""The transfer stages of a DataParallel call: argument trees scattered to the replicas, output trees gathered back
(concatenation, stacking of 0-dim outputs, None, sum/mean), their errors and warnings, and scatter -> replicas ->
gather as the identity. (PackedSequences are in test_packed_sequence.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dpfast

from dp_testing import DT, Losses, same_tensor, tensors

# ---- output errors ---------------------------------------------------------------------------------------------------


def test_output_errors():
    class Ragged(nn.Module):
        def forward(self, x):
            return (x,) if x.shape[0] == 2 else [x]

    with pytest.raises(
        ValueError,
        match=r"replicas returned different output structures: replica 0 returned a "
        r"tuple of length 1, replica 1 returned a list of length 1",
    ):
        dpfast.DataParallel(Ragged(), ["cpu"] * 2)(torch.zeros(3))

    class Label(nn.Module):
        def forward(self, x):
            return x, "label"

    # non-tensor outputs equal across replicas come back once (tests/test_stdlib_containers.py has the list case)
    assert dpfast.DataParallel(Label(), ["cpu"] * 2)(torch.zeros(3))[1] == "label"

    class Mixed(nn.Module):
        def forward(self, x):
            return x, (x if x.shape[0] == 2 else "label")

    with pytest.raises(
        TypeError,
        match=r"output `output\[1\]` is Tensor/str, which cannot be concatenated along "
        r"axis 0; give it out_dims None",
    ):
        dpfast.DataParallel(Mixed(), ["cpu"] * 2)(torch.zeros(3))
    out = dpfast.DataParallel(Label(), ["cpu"] * 2, out_dims=(0, None))(torch.zeros(3))
    assert out[1] == "label"

    with pytest.raises(
        ValueError,
        match=r"output `output` cannot be concatenated along axis 2: replica 0 returned "
        r"shape \(2, 1\)",
    ):
        dpfast.DataParallel(nn.Identity(), ["cpu"] * 2, out_dims=2)(torch.zeros(3, 1))

    class Varying(nn.Module):
        def forward(self, x):
            return torch.zeros(x.shape[0], x.shape[0])

    with pytest.raises(
        ValueError,
        match=r"output `output` cannot be concatenated along axis 0: the replicas returned \(2, 2\), \(1, 1\), "
        r"where axes \[0, 1\] all follow each replica's chunk \(\[2, 1\] samples\): a result between the samples "
        r"of one chunk \(a similarity or contrastive logits matrix\)",
    ):
        dpfast.DataParallel(Varying(), ["cpu"] * 2)(torch.zeros(3))

    class Growing(nn.Module):
        def forward(self, x):
            return torch.zeros(x.shape[0], 4 - x.shape[0])

    with pytest.raises(
        ValueError,
        match=r"output `output` cannot be concatenated along axis 0: replica 1 returned "
        r"\(1, 3\) torch.float32, replica 0 \(2, 2\)",
    ):
        dpfast.DataParallel(Growing(), ["cpu"] * 2)(torch.zeros(3))
    with pytest.raises(ValueError, match=r"output `output` cannot be averaged across replicas"):
        dpfast.DataParallel(Varying(), ["cpu"] * 2, out_dims="mean")(torch.zeros(3))
    with pytest.raises(TypeError, match=r"output `output\[1\]` is str; out_dims 'sum' needs tensors or numbers"):
        dpfast.DataParallel(Label(), ["cpu"] * 2, out_dims=(0, "sum"))(torch.zeros(3))


def test_out_dims_structure_errors():
    dp = dpfast.DataParallel(Losses(), ["cpu"] * 2, out_dims=("mean", "sum"))
    with pytest.raises(ValueError, match=r"out_dims for `output` has 2 specs but `output` is a tuple of length 3"):
        dp(torch.randn(4, 4), torch.randn(4, 2))
    dp = dpfast.DataParallel(Losses(), ["cpu"] * 2, out_dims={"loss": "mean"})
    with pytest.raises(
        TypeError,
        match=r"out_dims for `output` is a dict with keys \['loss'\], but `output` is a "
        r"tuple of length 3",
    ):
        dp(torch.randn(4, 4), torch.randn(4, 2))


def test_warns_when_output_batch_is_on_another_axis():
    """Seed 000 without out_dims: an even split concatenates the (L, B, H) state into a wrong shape; say so."""
    import warnings

    import dpfast

    class StateOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, h):
            return x * self.w, h * self.w

    dp = dpfast.DataParallel(StateOut(), device_ids=["cpu"] * 4, in_dims={"h": 1})
    x, h = torch.randn(8, 3), torch.randn(1, 8, 5)
    with pytest.warns(
        UserWarning, match=r"output `output\[1\]`.*axis 1 carries the batch chunk sizes \[2, 2, 2, 2\]"
    ) as got:
        dp(x, h)
    assert len(got) == 1, [str(w.message) for w in got]  # that one, not also the ambiguous-axis one
    right = dpfast.DataParallel(StateOut(), device_ids=["cpu"] * 4, in_dims={"h": 1}, out_dims=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = right(x, h)
    assert out[1].shape == h.shape


def test_warns_when_the_concatenation_axis_is_ambiguous():
    """A GRU state (layers, B, H) without out_dims, when each replica's chunk equals the layer count: axis 0
    carries the chunk sizes too, so the concatenation runs, into (16, 4, 4) where the plain module gives
    (4, 16, 4). The state went in on axis 1, so say that its axis 1 carries the chunk sizes as well."""
    import warnings

    import dpfast

    torch.manual_seed(0)
    gru = nn.GRU(3, 4, num_layers=4, batch_first=True)
    x, hx = torch.randn(16, 5, 3), torch.randn(4, 16, 4)
    dp = dpfast.DataParallel(gru, device_ids=["cpu"] * 4, in_dims={"hx": 1})
    with pytest.warns(UserWarning, match=r"output `output\[1\]`.*axis 0.*axis 1 also carries the batch chunk sizes"):
        out, h = dp(x, hx)
    assert h.shape == (16, 4, 4)  # what was asked for, and what the warning is about
    right = dpfast.DataParallel(gru, device_ids=["cpu"] * 4, in_dims={"hx": 1}, out_dims=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, h = right(x, hx)
        # a batch-first output whose feature axis equals the chunk size, with no input batched elsewhere: silent
        dpfast.DataParallel(nn.Linear(3, 4), device_ids=["cpu"] * 4)(torch.randn(16, 3))
    torch.testing.assert_close(h, gru(x, hx)[1])


# ---- gathered outputs -----------------------------------------------------------------------------------------


def test_scalar_outputs_stack_like_torch():
    torch.manual_seed(5)
    module = Losses().to(DT)
    x, y = torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)
    mse, sse, _ = dpfast.DataParallel(module, ["cpu"] * 3)(x, y)
    assert mse.shape == (3,) and sse.shape == (3,)
    expected = torch.stack([module(x[a:b], y[a:b])[1] for a, b in [(0, 3), (3, 5), (5, 7)]])
    torch.testing.assert_close(sse, expected)


def test_none_output_is_replica_zero_value_and_numbers_reduce():
    class M(nn.Module):
        def forward(self, x):
            return {"n": x.shape[0], "first": x[0], "mean_n": float(x.shape[0])}

    out = dpfast.DataParallel(M(), ["cpu"] * 3, out_dims={"n": "sum", "first": None, "mean_n": "mean"})(
        torch.arange(7.0)[:, None]
    )
    assert out["n"] == 7 and out["first"].item() == 0.0
    assert out["mean_n"] == pytest.approx((3 * 3 + 2 * 2 + 2 * 2) / 7)


# ---- properties ---------------------------------------------------------------------------------------------------


class Echo(nn.Module):
    def forward(self, a, b):
        return a, b


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_scatter_gather_identity(data):
    n = data.draw(st.integers(1, 5), label="n")
    batch = data.draw(st.integers(0, 12), label="B")
    ndim_a = data.draw(st.integers(1, 3), label="ndim a")
    ndim_b = data.draw(st.integers(1, 3), label="ndim b")
    da = data.draw(st.integers(-ndim_a, ndim_a - 1), label="dim a")
    db = data.draw(st.integers(-ndim_b, ndim_b - 1), label="dim b")
    weights = data.draw(st.none() | st.lists(st.integers(0, 4), min_size=n, max_size=n).filter(any), label="w")

    def shape(ndim, d):
        s = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
        s[d] = batch
        return s

    a = torch.randn(shape(ndim_a, da), dtype=DT, requires_grad=True)
    b = torch.randint(0, 100, shape(ndim_b, db))
    dp = dpfast.DataParallel(Echo(), ["cpu"] * n, in_dims=[da, db], out_dims=(da, db), chunk_sizes=weights)
    plan = dp.plan(a, b)
    assert sum(s for _, _, s in plan.replicas) == batch
    out_a, out_b = dp(a, b)
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    if n > 1:
        assert out_a is not a  # moved through the ops, not aliased (one device calls the module directly)
    if batch:
        out_a.sum().backward()
        assert torch.equal(a.grad, torch.ones_like(a))


@st.composite
def dp_case(draw):
    t = draw(tensors())
    dim = draw(st.integers(-t.dim(), t.dim() - 1))
    n = draw(st.integers(1, 5))
    weights = draw(
        st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=n, max_size=n).filter(lambda w: sum(w) > 0))
    )
    return t, dim, n, weights


@pytest.mark.usefixtures("one_thread")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp_case())
def test_property_data_parallel_identity_and_plan(case):
    t, dim, n, weights = case
    seen = []

    class Record(nn.Module):
        def forward(self, x):
            seen.append(x.shape[dim])
            return x

    dp = dpfast.DataParallel(Record(), ["cpu"] * n, dim=dim, chunk_sizes=weights)
    plan = dp.plan(t)
    out = dp(t)
    assert same_tensor(out, t.contiguous() if n > 1 else t)  # scatter -> replicas -> gather is the identity, bit-exact
    b = t.shape[dim]
    if n > 1 and b > 0:
        assert sum(plan.sizes) == b and sorted(seen) == sorted(s for s in plan.sizes if s > 0)
        if weights is None:
            assert max(plan.sizes) - min(plan.sizes) <= 1
