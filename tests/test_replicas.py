"""Persistent replicas (built once, refreshed every step, rebuilt when the module changes) and the worker pool.

Replicas on the module's own device are the module itself, so on the CPU the copy machinery is exercised with the
private switch ``dpfast.run.replicas._COPY_ON_SOURCE_DEVICE``: every slot after the first gets its own copy, as if it
were another device. Everything runs in float64 so that outputs and gradients can be compared with the plain module.
No timing assertions here: see benchmarks/bench_dp.py.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading

import pytest
import torch
from torch import nn

import dpfast
from dpfast.run import replicas as _replicas

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def copies(monkeypatch):
    """CPU slots after the first get copies, as other devices would."""
    monkeypatch.setattr(_replicas, "_COPY_ON_SOURCE_DEVICE", True)


class Net(nn.Module):
    """Records which module object ran each chunk, and whether its weight was a non-leaf copy."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("shift", torch.zeros(3))
        self.scale = 1.0
        self.seen: list = []

    def forward(self, x):
        self.seen.append((id(self), self.lin.weight.is_leaf, self.lin.weight.grad_fn is not None))
        y = self.out(self.drop(torch.tanh(self.lin(x)))) * self.scale + self.shift
        extra = getattr(self, "extra", None)
        if extra is not None:
            y = y + extra
        return y


def _net():
    torch.manual_seed(0)
    return Net().to(DT).eval()


def _x(rows=7):
    return torch.randn(rows, 4, dtype=DT, generator=torch.Generator().manual_seed(rows))


def _check_step(dp, plain, x):
    """One forward + backward through ``dp`` and through ``plain`` (a separate copy): equal outputs and grads."""
    src = dp.module
    src.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    out = dp(x)
    ref = plain(x)
    torch.testing.assert_close(out, ref)
    (out.sin().sum()).backward()
    (ref.sin().sum()).backward()
    for (name, p), q in zip(src.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    return out


def test_replicas_are_copies_built_once_and_gradients_sum_back(copies):
    src = _net()
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, ["cpu"] * 3)
    for _step in range(4):
        src.seen.clear()
        _check_step(dp, plain, _x(7))
        ids = {s[0] for s in src.seen}
        assert len(src.seen) == 3 and len(ids) == 3 and id(src) in ids  # the module itself + two copies
        assert sorted(s[1:] for s in src.seen if s[0] != id(src)) == [(False, True)] * 2  # non-leaf, with grad_fn
        with torch.no_grad():  # an SGD step: in place, so no rebuild, but the next step sees the new values
            for p in src.parameters():
                p -= 0.1 * p.grad
            for p in plain.parameters():
                p -= 0.1 * p.grad
    assert dp._replicas.builds == 1
    # the copies never show up in the wrapper's modules, parameters or state_dict
    assert len(list(dp.modules())) == 1 + len(list(src.modules()))
    assert list(dp.state_dict()) == ["module." + k for k in src.state_dict()]


def test_each_step_replaces_the_last_steps_copies(copies):
    """A step's copies stay in the replicas until the next step (a backward may recompute from them), which frees
    them: no copy outlives the step after its own."""
    import weakref

    src = _net()
    dp = dpfast.DataParallel(src, ["cpu"] * 2)
    dp(_x(4)).sum().backward()
    (rs,) = dp._replicas._sets
    slots = [s for replica in rs.replicas.values() for s in replica.param_slots]
    first = [weakref.ref(r._parameters[key]) for r, key, _, _ in slots]
    assert all(ref() is not None for ref in first)
    dp(_x(4)).sum().backward()
    gc.collect()
    assert all(ref() is None for ref in first)
    for r, key, _, _ in slots:
        assert r._parameters[key] is r._former_parameters[key]


def test_smaller_batch_uses_the_first_slots_of_the_same_set_and_no_grad_detaches(copies):
    src = _net()
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, ["cpu"] * 3)
    _check_step(dp, plain, _x(7))
    _check_step(dp, plain, _x(2))  # two replicas run: the first two slots of the same set
    _check_step(dp, plain, _x(7))
    assert dp._replicas.builds == 1
    src.seen.clear()
    with torch.no_grad():
        out = dp(_x(7))
    assert not out.requires_grad
    assert all(not s[2] for s in src.seen)  # copies made under no_grad have no grad_fn
    torch.testing.assert_close(out, plain(_x(7)))


# ---- invalidation: each way a module changes ---------------------------------------------------------------------


def _replace_weight(m):
    m.lin.weight = nn.Parameter(torch.randn(5, 4, dtype=DT))


def _add_parameter(m):
    m.extra = nn.Parameter(torch.randn(3, dtype=DT))


def _replace_buffer(m):
    m.shift = torch.full((3,), 0.25, dtype=DT)


def _replace_submodule(m):
    m.out = nn.Linear(5, 3).to(DT)


def _train(m):
    m.train()


def _plain_attribute(m):
    m.scale = 3.0


def _load_state_dict_assign(m):
    sd = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)


def _to_overwriting(m):
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        m.to(torch.float32).to(DT)  # new Parameter objects
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)


class _Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def _swap_class(m):
    m.out.__class__ = _Doubled  # what some patching tools do; the instance's __dict__ stays the same


REBUILDS = [
    _swap_class,
    _replace_weight,
    _add_parameter,
    _replace_buffer,
    _replace_submodule,
    _train,
    _plain_attribute,
    _load_state_dict_assign,
    _to_overwriting,
]


@pytest.mark.parametrize("change", REBUILDS, ids=[f.__name__.strip("_") for f in REBUILDS])
def test_module_changes_rebuild_the_replicas(copies, change):
    src = _net()
    dp = dpfast.DataParallel(src, ["cpu"] * 3)
    plain = copy.deepcopy(src)
    _check_step(dp, plain, _x(7))
    _check_step(dp, plain, _x(7))
    assert dp._replicas.builds == 1
    change(src)
    plain = copy.deepcopy(src)
    if src.training:  # dropout: the same mask needs the same random stream per chunk, so check the mode instead
        seen = []
        hook = src.drop.register_forward_hook(lambda mod, i, o: seen.append(mod.training))
        dp(_x(7)).sum().backward()
        hook.remove()
        assert seen == [True] * 3
        src.eval()
        plain.eval()
    _check_step(dp, plain, _x(7))
    assert dp._replicas.builds >= 2
    builds = dp._replicas.builds
    _check_step(dp, plain, _x(7))
    assert dp._replicas.builds == builds  # and persistent again afterwards


def _load_state_dict(m):
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})


def _to_in_place(m):
    m.to(torch.float32)


def _buffer_in_place(m):
    m.shift.add_(0.5)


IN_PLACE = [_load_state_dict, _to_in_place, _buffer_in_place]


@pytest.mark.parametrize("change", IN_PLACE, ids=[f.__name__.strip("_") for f in IN_PLACE])
def test_in_place_changes_are_refreshed_without_a_rebuild(copies, change):
    src = _net()
    dp = dpfast.DataParallel(src, ["cpu"] * 3)
    _check_step(dp, copy.deepcopy(src), _x(7))
    change(src)
    plain = copy.deepcopy(src)
    x = _x(7).to(src.lin.weight.dtype)
    out = _check_step(dp, plain, x)
    assert out.dtype == src.lin.weight.dtype
    # .to() converts parameters in place but replaces buffers (Module._apply), which is a rebuild
    assert dp._replicas.builds == (2 if change is _to_in_place else 1)


def test_tied_parameters_and_frozen_ones(copies):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight  # tied
            self.a.bias.requires_grad_(False)  # frozen

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    src = Tied().to(DT)
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, ["cpu"] * 3)
    for _ in range(2):
        _check_step(dp, plain, _x(7))
    assert src.a.bias.grad is None


def test_seed_rrn_lstm_through_persistent_copies(copies):
    from dpfast.__main__ import load_example  # the checkout's examples/, or the installed dpfast.examples

    rrn = load_example("rrn")
    IN_DIMS, OUT_DIMS, Config, build_model = rrn.IN_DIMS, rrn.OUT_DIMS, rrn.Config, rrn.build_model

    cfg = Config()
    torch.manual_seed(0)
    src = build_model(cfg).to(DT).eval()
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, ["cpu"] * 4, in_dims=IN_DIMS, out_dims=OUT_DIMS)
    gen = torch.Generator().manual_seed(3)
    for _step in range(3):
        x = torch.randn(10, cfg.n_facts, cfg.dim_hidden, generator=gen, dtype=DT)
        h = tuple(torch.randn(1, 10, cfg.dim_hidden, generator=gen, dtype=DT) for _ in range(2))
        src.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        got, want = dp(x, x, h), plain(x, x, h)
        torch.testing.assert_close(got, want)
        (got[0].sum() + got[2][1].pow(2).sum()).backward()
        (want[0].sum() + want[2][1].pow(2).sum()).backward()
        for (name, p), q in zip(src.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        with torch.no_grad():
            for m in (src, plain):
                for p in m.parameters():
                    p -= 0.05 * p.grad
    assert dp._replicas.builds == 1


def test_same_instance_from_two_threads_at_once(copies):
    src = _net()
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, ["cpu"] * 3)
    barrier = threading.Barrier(2)
    errors: list = []
    results: dict = {}

    def run(k):
        try:
            barrier.wait()
            for i in range(10):
                results[(k, i)] = dp(_x(7 + k))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (k, _), out in results.items():
        torch.testing.assert_close(out, plain(_x(7 + k)))


def test_deepcopy_and_pickle_start_afresh(copies):
    dp = dpfast.DataParallel(_net(), ["cpu"] * 3)
    dp(_x(7))
    for twin in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert twin._replicas is not dp._replicas and not twin._replicas._sets
        assert twin._pool is not dp._pool and not twin._pool.threads()
        torch.testing.assert_close(twin(_x(7)), dp(_x(7)))
        assert twin._replicas.builds == 1


# ---- the worker pool ---------------------------------------------------------------------------------------------


class _Turns(nn.Module):
    """Calls a collective, so the replicas of a device take turns on worker threads."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x):
        dpfast.all_reduce(x.sum())
        return self.net(x)


def test_pool_keeps_one_worker_per_extra_slot():
    dp = dpfast.DataParallel(_Turns(), ["cpu"] * 4)
    for rows in (8, 3, 8, 2, 8):
        dp(_x(rows))
    workers = dp._pool.threads()
    assert 1 <= len(workers) <= 3 and all(w.daemon for w in workers)


def test_pool_stops_when_the_wrapper_is_deleted():
    dp = dpfast.DataParallel(_Turns(), ["cpu"] * 3)
    dp(_x(6)).sum().backward()
    workers = dp._pool.threads()
    assert len(workers) == 2
    del dp
    gc.collect()
    for w in workers:
        w.join(timeout=5)
        assert not w.is_alive()


def test_pool_shutdown_then_reuse():
    dp = dpfast.DataParallel(_net(), ["cpu"] * 3)
    dp(_x(6))
    workers = dp._pool.threads()
    dp._pool.shutdown()
    assert not any(w.is_alive() for w in workers) and not dp._pool.threads()
    torch.testing.assert_close(dp(_x(6)), _net()(_x(6)))


# ---- CUDA ----------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_duplicate_ids_use_the_module_itself():
    src = _net().cuda()
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, [0, 0])
    src.seen.clear()
    _check_step(dp, plain, _x(7).cuda())
    assert {s[0] for s in src.seen} == {id(src)}
    assert dp._replicas.builds == 0


@pytest.mark.cuda
def test_cuda_persistent_copies_on_a_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    src = _net().cuda(0)
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, [0, 1, 1])
    for _ in range(3):
        src.seen.clear()
        _check_step(dp, plain, _x(7).cuda(0))
        assert len({s[0] for s in src.seen}) == 2  # the module on 0, one copy shared by both slots on 1
        with torch.no_grad():
            for m in (src, plain):
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert dp._replicas.builds == 1
    src.train()
    src.eval()  # training flag round trip: a rebuild, still equal
    _check_step(dp, plain, _x(7).cuda(0))


@pytest.mark.cuda
def test_cuda_copies_with_the_test_switch(copies):
    src = _net().cuda()
    plain = copy.deepcopy(src)
    dp = dpfast.DataParallel(src, [0, 0, 0])
    for _ in range(2):
        _check_step(dp, plain, _x(7).cuda())
    assert dp._replicas.builds == 1


def test_device_check_sees_changes_after_the_first_call():
    src = _net()
    dp = dpfast.DataParallel(src, ["cpu"] * 2)
    dp(_x(4))
    src.extra = nn.Parameter(torch.zeros(3, dtype=DT, device="meta"))  # a parameter on another device
    with pytest.raises(RuntimeError, match="module must have its parameters and buffers on device cpu"):
        dp(_x(4))
    del src.extra
    dp(_x(4))
    src.out.add_module("late", nn.Linear(1, 1, device="meta"))  # deeper in the tree, after the cache was built
    with pytest.raises(RuntimeError, match="found one of them on device: meta"):
        dp(_x(4))
    del src.out.late
    dp(_x(4))
    weight = src.out.weight
    src.out.weight = nn.Parameter(weight.detach().to("meta"))  # replaced under the same name
    with pytest.raises(RuntimeError, match="found one of them on device: meta"):
        dp(_x(4))
    src.out.weight = weight
    dp(_x(4))
    src.out.register_buffer("seen", torch.zeros(1, dtype=DT, device="meta"))  # a buffer
    with pytest.raises(RuntimeError, match="found one of them on device: meta"):
        dp(_x(4))


class MarksItself(nn.Module):
    """Sets an attribute of its own on its first forward, and reports per row whether it set it itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        if "mark" not in self.__dict__:
            self.mark = id(self)  # the module itself, once: its later replicas are copies of it, mark included
        return self.lin(x) * 0 + float(self.mark == id(self))


def test_a_module_that_changes_itself_once_in_its_forward_is_copied_again():
    """The module's own forward (replica 0) sets an attribute on its first call: the next call's replicas are
    copies of the module with it, not the copies made before (which would set their own). The write watch reads
    the module's dicts after that forward against snapshots of their own, and whatever it records must not stand
    for the replicas' snapshot at the next call."""
    src = MarksItself().to(DT)
    dp = dpfast.DataParallel(src, ["cpu"] * 2)
    x = _x(4)
    assert dp(x)[:, 0].tolist() == [1.0] * 4  # the first call: each set its own
    for _ in range(2):
        assert dp(x)[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # the module's mark, copied
    assert dp._replicas.builds == 2


def test_device_check_sees_a_tensor_moved_in_place():
    """A parameter or buffer moved in place (``torch.utils.swap_tensors``, as ``Module.to`` can) keeps its object,
    so the replicas' snapshot of the tree still holds (the device check reads the snapshot's tensors while it does):
    the call refuses it all the same."""
    src = _net()
    src.register_buffer("counted", torch.zeros(1, dtype=DT))
    dp = dpfast.DataParallel(src, ["cpu"] * 2)
    for _ in range(2):
        dp(_x(4))
    for t in (src.out.weight, src.counted):
        other = t.detach().to("meta").requires_grad_(t.requires_grad)
        other = nn.Parameter(other, t.requires_grad) if isinstance(t, nn.Parameter) else other
        torch.utils.swap_tensors(t, other)
        with pytest.raises(RuntimeError, match="found one of them on device: meta"):
            dp(_x(4))
        torch.utils.swap_tensors(t, other)
        dp(_x(4))
    assert dp._replicas.builds == 1  # (the tree never changed: the same snapshot throughout)


@pytest.mark.parametrize("where", ["the module", "a submodule", "in place"])
def test_compiled_modules_are_refused_before_anything_is_changed(where):
    """Copying a torch.compile'd module (its OptimizedModule forwards ``_parameters`` to the original) emptied the
    original's parameters: a KeyError, then a model that no longer works. The call refuses it and says what to do;
    compiling the wrapper works."""
    src = _net()
    plain = copy.deepcopy(src)
    if where == "the module":
        model = torch.compile(src, backend="eager")
    elif where == "a submodule":
        src.out = torch.compile(src.out, backend="eager")
        model = src
    else:  # Module.compile(): a compiled call bound to the module itself, which every copy would run
        src.out.compile(backend="eager")
        model = src
    with pytest.raises(TypeError, match=r"(torch.compile|compiled in place).*torch.compile\(dpfast.DataParallel\(mo"):
        dpfast.DataParallel(model, ["cpu"] * 3)(_x(7))
    assert len(list(src.parameters())) == len(list(plain.parameters()))
    torch.testing.assert_close(src(_x(7)), plain(_x(7)))
    torch.testing.assert_close(dpfast.DataParallel(model, ["cpu"])(_x(7)), plain(_x(7)))  # one device: no replicas


@pytest.mark.skipif(torch.__version__ < "2.14", reason="torch 2.4's dynamo fails tracing the wrapper (README)")
def test_the_compiled_wrapper_equals_the_module():
    """What the refusal above asks for instead: compile the wrapper, the module inside uncompiled."""
    src = _net()
    plain = copy.deepcopy(src)
    compiled = torch.compile(dpfast.DataParallel(src, ["cpu"] * 3), backend="eager")
    torch.testing.assert_close(compiled(_x(7)), plain(_x(7)))
