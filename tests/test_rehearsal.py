"""A rehearsal behaves like separate devices: replicas sharing a device have their own buffers and attributes (the
module's, taken at each call, changes discarded), run one at a time in a fixed order, and so are deterministic,
including checkpoint recomputation of their random draws."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpfast

from dp_testing import DT, bits


class Counted(nn.Module):
    """BatchNorm plus a plain attribute that forward changes (as modules do: step counters, caches)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.last_rows = x.shape[0]
        return self.bn(self.lin(x))


def _devices_run(module: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
    """What n separate devices do: replica 0 is the module itself, every other one a copy taken before any ran."""
    sizes = dpfast.plan.splits.split_sizes(x.shape[0], n)
    chunks = torch.split(x, sizes)
    before = copy.deepcopy(module)
    outs = [module(chunks[0])] + [copy.deepcopy(before)(c) for c in chunks[1:]]
    return torch.cat(outs)


def _steps(n: int, steps: int = 20, device: str = "cpu", ids=None):
    torch.manual_seed(n)
    module = Counted().to(DT).to(device)
    emulated = copy.deepcopy(module)
    dp = dpfast.DataParallel(module, ids or [device] * n)
    for step in range(steps):
        x = torch.randn(2 * n + step % 3, 3, dtype=DT, device=device)
        torch.testing.assert_close(dp(x), _devices_run(emulated, x, n), rtol=0, atol=1e-12)
    return module, emulated


def _assert_same_state(module, emulated, steps):
    assert module.calls == emulated.calls == steps  # one update per call: replica 0's
    assert module.bn.num_batches_tracked.item() == steps
    torch.testing.assert_close(module.bn.running_mean, emulated.bn.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(module.bn.running_var, emulated.bn.running_var, rtol=0, atol=1e-12)
    assert module.last_rows == emulated.last_rows


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_buffers_and_attributes_update_once_per_call_from_replica_zero(n, device):
    module, emulated = _steps(n, device=device)
    _assert_same_state(module, emulated, 20)


@pytest.mark.cuda
def test_replicas_on_a_second_gpu_have_buffers_of_their_own():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    module, emulated = _steps(3, device="cuda:0", ids=[0, 1, 1])  # two replicas share GPU 1's parameter copy
    _assert_same_state(module, emulated, 20)


def test_buffers_and_attributes_with_callers_on_two_threads():
    results, errors = {}, []

    def run(n):
        try:
            results[n] = _steps(n)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for module, emulated in results.values():
        _assert_same_state(module, emulated, 20)


def test_attributes_a_replica_sets_are_undone_at_the_next_call():
    class Remember(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            seen = getattr(self, "seen", None)
            self.seen = x.shape[0]
            self.lin.extra = nn.Linear(1, 1)  # a submodule added in forward, too
            return x + (0 if seen is None else seen)

    m = Remember()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    dp(torch.zeros(6, 2))
    out = dp(torch.zeros(6, 2))
    # replica 0 (the module) remembers its last chunk (2 rows); the others start from the module's state each call
    assert out[:2].eq(2).all() and out[2:].eq(2).all()
    assert m.seen == 2


def test_what_a_replica_changes_is_undone_at_the_next_call():
    """A replica's forward (not the module's) sets an attribute, replaces a buffer, adds a submodule and registers
    a hook on itself; the module's tree stays as it is, so the same replicas serve the next call, which must see
    each of them as a fresh copy of the module again."""

    class Marks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("offset", torch.zeros(1))
            self.mark = 0
            self.owner = id(self)  # an int: the replicas keep the module's

        def forward(self, x):
            out = x + self.mark + self.offset + 10 * len(self._forward_hooks) + 100 * hasattr(self, "extra")
            if id(self) != self.owner:  # a replica
                self.mark = self.mark + 1
                self.offset = self.offset + 1
                self.extra = nn.Linear(1, 1)
                self.register_forward_hook(lambda *args: None)
            return out

    m = Marks()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    first = dp(torch.zeros(6, 2))
    builds = dp._replicas.builds
    for _ in range(3):
        assert torch.equal(dp(torch.zeros(6, 2)), first)
    assert dp._replicas.builds == builds  # the same replicas, undone
    assert first.eq(0).all() and m.mark == 0 and not m._forward_hooks and not hasattr(m, "extra")


class Dropped(nn.Module):
    def __init__(self, use_checkpoint=None):
        super().__init__()
        self.lin = nn.Linear(5, 16)
        self.out = nn.Linear(16, 2)
        self.drop = nn.Dropout(0.5)
        self.use_checkpoint = use_checkpoint

    def block(self, x):
        return self.drop(torch.tanh(self.lin(x)))

    def forward(self, x):
        if self.use_checkpoint is None:
            h = self.block(x)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.use_checkpoint)
        return self.out(h)


def _train_step(module, n, x, seed):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)  # (reentrant checkpointing differentiates only when an input requires it)
    torch.manual_seed(seed)
    out = dpfast.DataParallel(module, [x.device] * n)(x) if n else module(x)
    w = torch.arange(out.numel(), dtype=DT, device=out.device).reshape(out.shape).sin()
    (out * w).sum().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("use_checkpoint", [None, True, False])
def test_fixed_seed_gives_bit_identical_outputs_and_gradients(use_checkpoint, device):
    torch.manual_seed(0)
    module = Dropped(use_checkpoint).to(DT).to(device)
    x = torch.randn(11, 5, dtype=DT, device=device)
    runs = [_train_step(module, 4, x, seed=7) for _ in range(3)]
    for out, grads in runs[1:]:
        assert torch.equal(bits(out), bits(runs[0][0]))
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(grads, runs[0][1]))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_replays_each_replicas_own_draws(use_reentrant):
    """The replicas of a device run in turn, so their draws are those of the module run on the chunks in turn, and
    checkpoint recomputation replays them: gradients equal the run without checkpointing, step after step."""
    torch.manual_seed(0)
    plain = Dropped(None).to(DT)
    ckpt = copy.deepcopy(plain)
    ckpt.use_checkpoint = use_reentrant
    for step in range(10):
        x = torch.randn(9, 5, dtype=DT)
        out_p, grads_p = _train_step(plain, 3, x, seed=step)
        out_c, grads_c = _train_step(ckpt, 3, x, seed=step)
        torch.testing.assert_close(out_c, out_p, rtol=0, atol=0)
        for a, b in zip(grads_c, grads_p):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-15)
        # and the draws are the in-turn run's: the module on chunks [3, 3, 3], one after another (the same masks;
        # the last bits may differ, as one matmul on another allocation can)
        torch.manual_seed(step)
        in_turn = torch.cat([plain(c.clone()) for c in torch.split(x, [3, 3, 3])])
        torch.testing.assert_close(out_p, in_turn.detach(), rtol=0, atol=1e-12)


def test_hooks_a_replica_installs_stay_its_own():
    """HF models install output-capturing forward hooks on first use and mark the model as hooked: a replica doing
    so must not add hooks to the module's submodules (they would fire once per replica's install, call after
    call), and hooks registered on the module reach every replica."""
    captured = []

    class LazyHooks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            if not getattr(self, "hooked", False):
                for layer in (self.a, self.b):
                    layer.register_forward_hook(lambda mod, args, out: captured.append(out.shape[0]))
                self.hooked = True
            return self.b(self.a(x))

    m = LazyHooks()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    for _ in range(3):
        captured.clear()
        dp(torch.zeros(6, 2))
        assert sorted(captured) == [2] * 6  # two layers per replica, each hook once
    assert len(m.a._forward_hooks) == 1 and len(m.b._forward_hooks) == 1
    m.a.register_forward_hook(lambda mod, args, out: captured.append(-1))
    captured.clear()
    dp(torch.zeros(6, 2))
    assert captured.count(-1) == 3  # a hook added to the module later runs on every replica


def test_hooks_re_registered_in_another_order_reach_the_replicas():
    """The replicas' hooks follow the module's by their ids in order: removing one and prepending another keeps
    the same count, and must still be seen."""
    order = []
    m = nn.Linear(2, 2)
    m.register_forward_hook(lambda mod, a, o: order.append("A"))
    old = m.register_forward_hook(lambda mod, a, o: order.append("old"))
    m.register_forward_hook(lambda mod, a, o: order.append("C"))
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    dp(torch.zeros(3, 2))
    old.remove()
    m.register_forward_hook(lambda mod, a, o: order.append("NEW"), prepend=True)  # same count, same last hook
    order.clear()
    dp(torch.zeros(3, 2))
    assert order == ["NEW", "A", "C"] * 3


def test_a_replica_set_used_once_does_not_keep_its_tensors():
    import gc
    import weakref

    refs = []

    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.cache = h = self.lin(x)  # an activation kept on the module, as for inspection
            refs.append(weakref.ref(h))
            return h

    dp = dpfast.DataParallel(Keeps(), ["cpu"] * 3)
    dp(torch.randn(2, 4)).sum().backward()  # a last, smaller batch: a set of 2 replicas
    small = list(refs)
    for _ in range(2):
        dp(torch.randn(9, 4)).sum().backward()
    gc.collect()
    assert all(r() is None for r in small)


class Owned(nn.Module):
    """An LSTM (its __setattr__ tracks _flat_weights) and a Linear; forward reports the Parameters it holds."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        held = torch.tensor([float(len(list(self.parameters())))], dtype=x.dtype).expand(x.shape[0])
        return self.lin(self.lstm(x)[0][:, -1]), held


def test_replicas_see_the_parameters_as_the_module_does_without_registering_them():
    """Every replica's parameters() is the module's (code that reads a replica's parameters, a dtype probe,
    functional_call, sees them as on replica 0; torch's replicas have none), yet no step registers a Parameter
    anywhere: a global registration hook (as profilers and FSDP-style tools install) does not fire per replica per
    step. Outputs and gradients equal the module's."""
    torch.manual_seed(0)
    module = Owned().to(DT)
    plain = copy.deepcopy(module)
    dp = dpfast.DataParallel(module, ["cpu"] * 3)
    calls = []
    hook = nn.modules.module.register_module_parameter_registration_hook(lambda *a: calls.append(a[1]))
    try:
        x = torch.randn(6, 5, 3, dtype=DT)
        for _ in range(2):
            (out, held), (ref, _) = dp(x), plain(x)
            torch.testing.assert_close(out, ref)
            out.sum().backward()
            ref.sum().backward()
    finally:
        hook.remove()
    assert calls == []
    assert held.tolist() == [6.0] * 6
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
