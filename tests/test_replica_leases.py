"""Replicas kept between calls are a speed device, never a semantic one: what a pending autograd graph needs
(a checkpoint recomputes a replica's forward from its modules) stays alive and unchanged whatever later calls do,
nothing of an old module tree outlives the next call, and one replica set serves every replica count.

Everything is float64 and compared with the unwrapped module doing the same steps.
"""

from __future__ import annotations

import collections
import copy
import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpfast
from dpfast.run import replicas as _replicas

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["shared", "copies"])
def layout(request, monkeypatch):
    """Replicas on the module's device share its parameters; with the test switch each gets a copy, as another
    device would."""
    if request.param == "copies":
        monkeypatch.setattr(_replicas, "_COPY_ON_SOURCE_DEVICE", True)
    return request.param


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, norm: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6) if norm else nn.Identity()
        self.out = nn.Linear(6, 2)
        self.reentrant = reentrant

    def block(self, x):
        return torch.tanh(self.norm(self.lin(x)))

    def forward(self, x):
        return self.out(checkpoint(self.block, x, use_reentrant=self.reentrant))


def _pair(reentrant, norm=False):
    torch.manual_seed(0)
    m = Checkpointed(reentrant, norm).to(DT)
    return m, copy.deepcopy(m)


def _x(rows, seed=0):
    return torch.randn(rows, 4, dtype=DT, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _assert_same_grads(module, plain):
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_backward_survives_a_call_with_another_replica_count(layout, reentrant):
    """Was: AttributeError 'Linear' object has no attribute 'weight' (the 3-replica set was cleared by the
    2-replica call while the pending graph still had to recompute from it)."""
    m, plain = _pair(reentrant)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = _x(12)
    loss = (dp(x) ** 2).sum()
    (dp(_x(2, seed=1)) ** 2).sum()  # two replicas, its graph dropped at once
    loss.backward()
    (plain(x.detach().requires_grad_()) ** 2).sum().backward()
    _assert_same_grads(m, plain)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("between", ["inference_mode", "no_grad"])
def test_a_checkpointed_batchnorm_backward_survives_an_eval_call(layout, reentrant, between):
    """Was: RuntimeError Inplace update to inference tensor outside InferenceMode (the eval call refilled the
    replicas with inference-mode buffers that the recomputation then updated)."""
    m, plain = _pair(reentrant, norm=True)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = _x(12)
    loss = (dp(x) ** 2).sum()
    context = torch.inference_mode() if between == "inference_mode" else torch.no_grad()
    with context:
        dp(_x(12, seed=2))
    loss.backward()
    xp = x.detach().requires_grad_()
    # what separate devices do: each chunk's batch statistics, in the forward and in its recomputation
    (torch.cat([plain(c) for c in xp.split(4)]) ** 2).sum().backward()
    _assert_same_grads(m, plain)


@pytest.mark.parametrize("reentrant", [True, False])
def test_two_pending_graphs_of_the_same_replica_count(layout, reentrant):
    """Gradient accumulation: two checkpointed calls of the same replica count, then one backward: each graph
    recomputes from its own replicas."""
    m, plain = _pair(reentrant)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x1, x2 = _x(9, seed=1), _x(9, seed=2)
    first = (dp(x1) ** 2).sum()
    second = (dp(x2) ** 2).sum()
    (first + second).backward()
    ((plain(x1.detach().requires_grad_()) ** 2).sum() + (plain(x2.detach().requires_grad_()) ** 2).sum()).backward()
    _assert_same_grads(m, plain)
    assert dp._replicas.builds == 2  # the second call could not take the set the first graph still leased


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_lease_ends_with_its_graph(reentrant):
    """Once nothing of the graph that leased a set can reach its replicas, the next call reuses the set: a
    non-reentrant checkpoint lets go of them in backward, a reentrant one when its graph is freed."""
    m, _ = _pair(reentrant)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    for _ in range(5):
        loss = (dp(_x(9)) ** 2).sum()
        loss.backward()
        del loss
    assert dp._replicas.builds == 1
    for _ in range(5):  # the training loop's way: the last step's loss is still alive at the next call
        loss = (dp(_x(9)) ** 2).sum()
        loss.backward()
    assert dp._replicas.builds == (2 if reentrant else 1)  # two sets taking turns, at most


@pytest.mark.parametrize("change", ["replace_submodule", "load_state_dict_assign"])
def test_nothing_of_an_old_module_tree_outlives_the_next_call(layout, change):
    """Was: after calls with two batch sizes, the old submodule and old parameters stayed alive in the cached set
    of the other replica count (a second copy of the weights on a GPU)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    for rows in (12, 2):
        (dp(_x(rows)) ** 2).sum().backward()
    old = [weakref.ref(m[2]), *(weakref.ref(p) for p in m.parameters())]
    if change == "replace_submodule":
        m[2] = nn.Linear(6, 2).to(DT)
        old = old[:1] + old[-2:]  # the submodule and its two parameters
    else:
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True)
        old = old[1:]  # every parameter
    dp(_x(12))
    gc.collect()
    assert [r() is None for r in old] == [True] * len(old)


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_old_tree_leased_to_a_pending_graph_goes_with_that_graph(layout, reentrant):
    m, plain = _pair(reentrant)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = _x(12)
    loss = (dp(x) ** 2).sum()
    old = weakref.ref(m.out.weight)
    m.out = nn.Linear(6, 2).to(DT)  # a new tree for the next call; the pending graph keeps its own replicas
    dp(_x(12, seed=3))
    gc.collect()
    assert old() is not None  # its recomputation reads them: torch's replicas would live as long
    loss.backward()
    (plain(x.detach().requires_grad_()) ** 2).sum().backward()
    torch.testing.assert_close(old().grad, plain.out.weight.grad)
    del loss
    gc.collect()
    assert old() is None


def test_every_batch_size_of_a_workload_reuses_one_set():
    """Was: 500 calls with B = 1..17 on 8 devices rebuilt 176 sets (4 cached, one per replica count, LRU)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)).to(DT)
    plain = copy.deepcopy(m)
    dp = dpfast.DataParallel(m, ["cpu"] * 8)
    for step in range(60):
        rows = 2 + step % 16
        x = _x(rows, seed=step)
        with torch.no_grad() if step % 3 == 0 else torch.enable_grad():
            out = dp(x)
        chunks = [c for c in x.split(dpfast.plan.splits.split_sizes(rows, 8)) if len(c)]
        torch.testing.assert_close(out, torch.cat([plain(c) for c in chunks]))
    assert dp._replicas.builds == 1


_LEAF = st.sampled_from(["tensor", "grad tensor", 1, 2.5, True, "text", None])


def _build(shape):
    if isinstance(shape, str) and shape.endswith("tensor"):
        return torch.ones(2, requires_grad=shape == "grad tensor") * 1
    if isinstance(shape, list):
        return [_build(s) for s in shape]
    if isinstance(shape, tuple):
        return tuple(_build(s) for s in shape)
    if isinstance(shape, dict):
        return {k: _build(s) for k, s in shape.items()}
    return shape


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        _LEAF,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.lists(inner, max_size=4).map(tuple)
            | st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
        ),
        max_leaves=12,
    )
)
def test_every_output_tensor_with_a_graph_carries_the_lease(shape):
    """The lease's token reaches the grad_fn of every tensor of the outputs that has one (the walk finds them all,
    whatever the nesting of lists, tuples and dicts)."""
    outputs = _build(shape)
    assert _replicas._lease_to_graph(outputs) is not None or not any(
        isinstance(v, torch.Tensor) and v.grad_fn is not None for v in _replicas.flatten(outputs)[0]
    )
    for v in _replicas.flatten(outputs, whole_atoms=True)[0]:
        if isinstance(v, torch.Tensor) and v.grad_fn is not None:
            meta = v.grad_fn.metadata
            assert _replicas._TOKEN in (meta() if callable(meta) else meta)


def test_a_namedtuple_output_leases_the_set_to_its_graph():
    Pair = collections.namedtuple("Pair", "a b")

    class Out(nn.Module):  # a namedtuple output still leases the set to its graph (through the full flatten)
        def forward(self, x):
            return Pair(x * 2, x.sum())

    dp = dpfast.DataParallel(Out(), ["cpu"] * 2)
    out = dp(torch.ones(4, 2, requires_grad=True))
    rs = dp._replicas._sets[0]
    assert rs.graph is not None and rs.graph() is not None
    del out
    gc.collect()
    assert rs.graph() is None
