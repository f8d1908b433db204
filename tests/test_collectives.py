"""dpfast.all_gather / all_reduce / replica_index / replica_count inside forward: across a DataParallel call's
replicas (values and gradients equal the full-batch computation), the identity outside, clean errors instead of
hangs when a replica fails or skips one; the same model under DistributedDataParallel is in test_distributed.py."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import dpfast
from dpfast.run.rendezvous import CollectiveError

from dp_testing import DT, Contrastive


@pytest.mark.parametrize("n, batch", [(2, 8), (3, 7), (4, 9)])
def test_contrastive_loss_with_negatives_from_the_whole_batch_equals_one_device(n, batch, device):
    torch.manual_seed(n)
    module = Contrastive().to(DT).to(device)
    plain = copy.deepcopy(module)
    a, b = torch.randn(batch, 6, dtype=DT, device=device), torch.randn(batch, 6, dtype=DT, device=device)
    loss = dpfast.DataParallel(module, [device] * n, out_dims="sum")(a, b)
    expected = plain(a, b)  # outside a call: all_gather is the identity, replica 0 of 1
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for p, q in zip(module.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class Reduce(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return (dpfast.all_reduce(x.sum(0) * (dpfast.replica_index() + 1), self.op),)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce_values_and_gradients(op):
    x = torch.randn(7, 3, dtype=DT, requires_grad=True)
    (out,) = dpfast.DataParallel(Reduce(op), ["cpu"] * 3, out_dims=(None,))(x)  # each replica has the result
    parts = [c.sum(0) * (i + 1) for i, c in enumerate(torch.split(x, [3, 2, 2]))]
    stacked = torch.stack(parts)
    expected = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    torch.testing.assert_close(out, expected)
    (g,) = torch.autograd.grad((out * torch.arange(1.0, 4.0, dtype=DT)).sum(), x)
    (g_ref,) = torch.autograd.grad((expected * torch.arange(1.0, 4.0, dtype=DT)).sum(), x)
    torch.testing.assert_close(g, g_ref)


def test_every_replica_gets_bit_identical_results():
    class Each(nn.Module):
        def forward(self, x):
            return dpfast.all_reduce(x.sum(0, keepdim=True), "mean"), dpfast.all_gather(x * 1.0, 0)

    x = torch.randn(10, 4, dtype=DT)
    mean, gathered = dpfast.DataParallel(Each(), ["cpu"] * 4, out_dims=(0, 0))(x)
    assert all(torch.equal(m, mean[0]) for m in mean)
    assert all(torch.equal(g, x) for g in gathered.split(10))


def test_index_count_and_identity_outside_a_call():
    t = torch.randn(3, 2)
    assert dpfast.all_gather(t) is t and dpfast.all_reduce(t, "max") is t
    assert (dpfast.replica_index(), dpfast.replica_count()) == (0, 1)

    class Who(nn.Module):
        def forward(self, x):
            return torch.tensor([[dpfast.replica_index(), dpfast.replica_count()]] * x.shape[0])

    out = dpfast.DataParallel(Who(), ["cpu"] * 3)(torch.zeros(5))
    assert out.tolist() == [[0, 3], [0, 3], [1, 3], [1, 3], [2, 3]]
    assert dpfast.DataParallel(Who(), ["cpu"] * 3)(torch.zeros(1)).tolist() == [[0, 1]]  # one replica runs


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="t must be a Tensor"):
        dpfast.all_gather([1, 2])
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        dpfast.all_gather(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="op is 'prod'"):
        dpfast.all_reduce(torch.zeros(2), "prod")


def _call_in_thread(fn):
    """Run fn in a thread and fail (instead of hanging the suite) if it does not return."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the call hung"
    return box


def test_a_replica_raising_before_a_collective_fails_the_call_cleanly():
    class FailsFirst(nn.Module):
        def forward(self, x):
            if dpfast.replica_index() == 1:
                raise ValueError("replica one cannot go on")
            return dpfast.all_reduce(x.sum())

    box = _call_in_thread(lambda: dpfast.DataParallel(FailsFirst(), ["cpu"] * 3, out_dims=None)(torch.ones(6)))
    err = box["error"]
    # the root cause is what the call raises; the replicas left waiting got an error naming it
    assert type(err) is ValueError and str(err).startswith("replica 1 on cpu raised ValueError: replica one cannot")


def test_a_replica_skipping_a_collective_is_an_error_not_a_hang():
    class Skips(nn.Module):
        def forward(self, x):
            if dpfast.replica_index() == 2:
                return x.sum()
            return dpfast.all_reduce(x.sum())

    box = _call_in_thread(lambda: dpfast.DataParallel(Skips(), ["cpu"] * 3, out_dims="sum")(torch.ones(6)))
    err = box["error"]
    assert isinstance(err, CollectiveError) and "replica 2 on cpu returned without calling it" in str(err)


def test_replicas_calling_different_collectives_is_an_error():
    class Differs(nn.Module):
        def forward(self, x):
            if dpfast.replica_index() == 1:
                return dpfast.all_gather(x, 0).sum()
            return dpfast.all_reduce(x.sum())

    box = _call_in_thread(lambda: dpfast.DataParallel(Differs(), ["cpu"] * 2, out_dims="sum")(torch.ones(4)))
    assert isinstance(box["error"], CollectiveError) and "differs across replicas" in str(box["error"])


def test_mismatched_shapes_are_an_error_naming_the_replicas():
    class Shapes(nn.Module):
        def forward(self, x):
            return dpfast.all_reduce(x.sum(0, keepdim=True).expand(dpfast.replica_index() + 1, 2).sum(1))

    box = _call_in_thread(lambda: dpfast.DataParallel(Shapes(), ["cpu"] * 2, out_dims=None)(torch.ones(4, 2)))
    assert isinstance(box["error"], CollectiveError) and "replica 1 gave shape (2,)" in str(box["error"])


def test_many_collectives_keep_the_replicas_in_step_and_in_order():
    order = []

    class Steps(nn.Module):
        def forward(self, x):
            for k in range(5):
                order.append((k, dpfast.replica_index()))
                x = x + dpfast.all_reduce(x.mean(), "mean")
            return x

    x = torch.randn(8, dtype=DT)
    out = dpfast.DataParallel(Steps(), ["cpu"] * 4)(x)
    ref = x.clone()
    for _ in range(5):
        ref = ref + torch.stack([c.mean() for c in ref.split(2)]).mean()
    torch.testing.assert_close(out, ref)
    assert order == [(k, i) for k in range(5) for i in range(4)]  # the replicas of a device take turns in order


# ---- found in review ---------------------------------------------------------------------------------------------


def test_a_no_grad_block_around_a_collective_stays_in_its_replica():
    """The replicas after the first start on worker threads at its collective: they take the caller's state, not
    that of the block around the collective (they ran their whole forward without grad)."""

    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                n = dpfast.all_reduce(torch.tensor([float(x.shape[0])]))
            return self.lin(x) / n

    torch.manual_seed(0)
    m = Counted().to(DT)
    x = torch.randn(8, 3, dtype=DT)
    out = dpfast.DataParallel(m, ["cpu"] * 4)(x)
    out.sum().backward()
    got = m.lin.weight.grad.clone()
    m.zero_grad()
    (m.lin(x) / 8).sum().backward()
    torch.testing.assert_close(got, m.lin.weight.grad)


def test_changing_a_deposit_in_place_does_not_change_what_others_receive():
    class Mutates(nn.Module):
        def forward(self, x):
            h = x * 1.0
            g = dpfast.all_gather(h, 0)
            h.relu_()  # this replica's turn is back: the others may not have read its deposit yet
            return g.sum().reshape(1)

    x = -torch.ones(8, dtype=DT)
    out = dpfast.DataParallel(Mutates(), ["cpu"] * 4)(x)
    assert out.tolist() == [-8.0] * 4


def test_a_failed_collective_leaves_no_cycle_and_each_replica_its_own_error():
    import gc
    import weakref

    kept = []

    class Fails(nn.Module):
        def forward(self, x):
            y = x * 2
            kept.append(weakref.ref(y))
            if dpfast.replica_index() == 2:
                raise ValueError("two fails")
            return dpfast.all_reduce(y.sum())

    gc.collect()
    gc.disable()
    try:
        with pytest.raises(ValueError, match="two fails"):
            dpfast.DataParallel(Fails(), ["cpu"] * 3, out_dims="sum")(torch.ones(6, requires_grad=True))
        assert len(kept) == 3 and all(r() is None for r in kept)  # freed by reference counting alone
    finally:
        gc.enable()


def test_a_worker_that_cannot_start_fails_its_replica_instead_of_hanging(monkeypatch):
    from dpfast.run import workers as _workers

    def cannot_start(self, fn, done):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_workers.WorkerPool, "submit", cannot_start)

    class Turns(nn.Module):
        def forward(self, x):
            return dpfast.all_reduce(x.sum())

    box = _call_in_thread(lambda: dpfast.DataParallel(Turns(), ["cpu"] * 2, out_dims="sum")(torch.ones(4)))
    assert isinstance(box["error"], RuntimeError) and "can't start new thread" in str(box["error"])


def test_a_forwards_collective_log_is_freed_by_reference_counting():
    """DistributedDataParallel keeps one CollectiveLog a forward (with a ghost's results: tensors with their graphs);
    it must go when its last reference does, not wait for a garbage collection."""
    import gc
    import weakref

    from dpfast.distributed.empty_ranks import CollectiveLog

    gc.collect()
    gc.disable()
    try:
        log = CollectiveLog(keep_results=True)
        with log:
            log.results.append(torch.ones(3, requires_grad=True) * 2)
        gone = weakref.ref(log), weakref.ref(log.results[0])
        del log
        assert [r() for r in gone] == [None, None]
    finally:
        gc.enable()
