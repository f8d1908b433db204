"""Callables bound to modules of the tree run on the replica (as on a separate device, where the replica is a copy
of its own), and a replica > 0 that still writes to the module's own state in a rehearsal is named: on GPUs the
same code fails, so the rehearsal must not show a success the GPU run will not give."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.block(x))


def _scaled_forward(self, x):  # a forward bound to one instance, as accelerate binds them
    return 2 * self.out(self.block(x))


def _block_forward(self, x):
    return self[1](self[0](x)) + 1


def _x(rows=9):
    return torch.randn(rows, 3, dtype=DT, generator=torch.Generator().manual_seed(rows))


def _separate_devices(plain, x, n):
    """What n devices compute: the module on the first chunk, a copy taken before any ran on each other chunk."""
    before = copy.deepcopy(plain)
    chunks = x.split(dpfast.plan.splits.split_sizes(x.shape[0], n))
    return torch.cat([plain(chunks[0])] + [copy.deepcopy(before)(c) for c in chunks[1:]])


@pytest.mark.parametrize("where", ["module", "submodule"])
def test_a_forward_bound_to_the_instance_runs_on_each_replica(where):
    """Was: every replica ran the module's own bound forward, so BatchNorm counted 3 batches a call."""
    torch.manual_seed(0)
    m = Normed().to(DT)
    if where == "module":
        m.forward = types.MethodType(_scaled_forward, m)
    else:
        m.block.forward = types.MethodType(_block_forward, m.block)
    plain = copy.deepcopy(m)  # deepcopy rebinds bound methods to the copy too
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    for step in range(3):
        x = _x(9 + step)
        torch.testing.assert_close(dp(x), _separate_devices(plain, x, 3))
    assert m.block[1].num_batches_tracked.item() == 3
    torch.testing.assert_close(m.block[1].running_mean, plain.block[1].running_mean)


def test_accelerate_hooks_run_on_each_replica():
    hooks = pytest.importorskip("accelerate.hooks")
    seen = []

    class Shift(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(module)
            return tuple(a + 1 for a in args), kwargs

    torch.manual_seed(0)
    m = Normed().to(DT)
    hooks.add_hook_to_module(m.block, Shift())
    plain = copy.deepcopy(m)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = _x(9)
    want = _separate_devices(plain, x, 3)
    seen.clear()
    torch.testing.assert_close(dp(x), want)
    assert seen[0] is m.block and len({id(s) for s in seen}) == 3  # the module's block, then each replica's
    assert m.block[1].num_batches_tracked.item() == 1


def test_a_metric_updated_in_forward_is_named():
    """torchmetrics keeps its wrapped update in the instance __dict__ (a closure over self): rebound, it runs on
    the replica, whose states are the module's tensors (a shallow copy) updated in place. On GPUs that update
    fails with a device mismatch; in the rehearsal it is a warning naming the metric's state."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Tracked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)
            self.metric = torchmetrics.MeanMetric()

        def forward(self, x):
            y = self.lin(x)
            self.metric.update(y.detach())
            return y

    m = Tracked()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    with pytest.warns(RuntimeWarning, match=r"replica 1, 2, .*`metric\.mean_value` was changed in place"):
        dp(_x(9).float())
    assert m.metric._update_count == 1  # the wrapped update ran on each replica's own copy of the counter


class WritesThrough(nn.Module):
    """Replicas reach the module itself through an object it shares with them (a closure, a global...)."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(()))
        self.total = torch.zeros(())  # a plain tensor attribute: shared by the replicas' shallow copies
        self.shared = {"model": self}  # not a module of the tree: what a replica finds there is the module
        self.how = how

    def forward(self, x):
        if self.how == "in place":
            self.total += x.sum().detach()
        elif self.how == "through the module":
            self.shared["model"].last_input = x
        return self.lin(x)


@pytest.mark.parametrize(("how", "named"), [("in place", "`total` was changed in place"),
                                            ("through the module", "`last_input` was set")])  # fmt: skip
def test_a_replica_writing_to_the_modules_state_is_named(how, named):
    dp = dpfast.DataParallel(WritesThrough(how), ["cpu"] * 3)
    with pytest.warns(RuntimeWarning, match=rf"replica 1, 2, sharing the module's device.*{named}"):
        dp(_x(9).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(_x(9).float())  # said once per wrapper


class OthersWriteThrough(nn.Module):
    """Only the replicas after the first write, so the module's own turn leaves its tree as it was copied."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.total = torch.zeros(())
        self.shared = {"model": self}
        self.how = how

    def forward(self, x):
        if dpfast.replica_index() == 2:
            if self.how == "in place":
                self.total += 1
            elif self.how == "through the module":
                self.shared["model"].last_input = x
        return self.lin(x)


@pytest.mark.parametrize(("how", "named"), [("in place", "`total` was changed in place"),
                                            ("through the module", "`last_input` was set")])  # fmt: skip
def test_a_write_is_named_when_the_module_itself_wrote_nothing(how, named):
    """The watch reads the module's state as its replicas were copied from it (the kept snapshot) when the module's
    own turn changed nothing: a write by a later replica is still seen, at every call."""
    m = OthersWriteThrough(how)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dpfast.DataParallel(OthersWriteThrough("nothing"), ["cpu"] * 3)(_x(9).float())
    for _ in range(2):  # the second call: the replica set of the first, refreshed
        dp._replicas.reported.clear()
        with pytest.warns(RuntimeWarning, match=rf"replica 2, sharing the module's device.*{named}"):
            dp(_x(9).float())
    if how != "in place":
        del m.last_input
        dp._replicas.reported.clear()
        with pytest.warns(RuntimeWarning, match=rf"replica 2, .*{named}"):
            dp(_x(9).float())


def test_ordinary_modules_are_not_named():
    dp = dpfast.DataParallel(Normed().train(), ["cpu"] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            dp(_x(9).float()).sum().backward()
