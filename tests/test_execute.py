"""Running the replicas (dpfast.run.execute, dpfast.run.workers): exceptions named by replica and device, nothing left
running behind a call, the caller's thread-local state (grad and inference mode, autocast, saved-tensor hooks) in
every replica thread, the worker pool across forks, and faults injected into replicas (every k-th call, in forward or
in backward, on the CPU and on CUDA streams): each step after a failure is as good as any other."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT, MLP

# ---- exceptions and threads -----------------------------------------------------------------------------------


class Fails(nn.Module):
    def forward(self, x):
        if (x < 0).any():
            raise ValueError(f"negative input in a chunk of {x.shape[0]}")
        return x


def test_replica_exception_names_replica_and_device():
    x = torch.tensor([1.0, 2, 3, 4, 5, -6, 7])  # chunks [2, 2, 2, 1] on 4 replicas: -6 lands in replica 2
    with pytest.raises(ValueError, match=r"^replica 2 on cpu raised ValueError: negative input in a chunk of 2$") as e:
        dpfast.DataParallel(Fails(), ["cpu"] * 4)(x)
    cause = e.value.__cause__
    assert type(cause) is ValueError and str(cause) == "negative input in a chunk of 2"
    assert cause.__traceback__ is not None


def test_no_work_left_behind_and_no_thread_growth():
    finished = []

    class SlowAndFailing(nn.Module):
        def forward(self, x):
            if x.shape[0] == 1:
                raise ValueError("fast failure")
            time.sleep(0.2)
            finished.append(x.shape[0])
            return x

    dp = dpfast.DataParallel(SlowAndFailing(), ["cpu"] * 3)
    with pytest.raises(ValueError, match="replica 2 on cpu raised ValueError: fast failure"):
        dp(torch.zeros(5))  # chunks [2, 2, 1]
    assert sorted(finished) == [2, 2]  # the call raised only after the slow replicas had finished
    before = threading.active_count()
    for _ in range(5):
        with pytest.raises(ValueError):
            dp(torch.zeros(5))
        dpfast.DataParallel(Fails(), ["cpu"] * 3)(torch.ones(6))
    # idle workers are reused, not piled up; the pools of the discarded instances stop their workers as they are
    # collected, which happens on other threads' time: wait for that rather than race it
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before


def test_replica_exception_several_and_unbuildable_types():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    class M(nn.Module):
        def forward(self, x):
            raise Odd(x.shape[0], "x")

    with pytest.raises(RuntimeError, match=r"^replica 0 on cpu raised Odd: 2/x \(2 other replicas failed too\)$") as e:
        dpfast.DataParallel(M(), ["cpu"] * 3)(torch.zeros(6))
    assert isinstance(e.value.__cause__, Odd)


def test_single_replica_runs_inline_and_raises_unchanged():
    threads = []

    class M(nn.Module):
        def forward(self, x):
            threads.append(threading.current_thread())
            if x.shape[0] == 0:
                raise KeyError("empty")
            return x

    dp = dpfast.DataParallel(M(), ["cpu"] * 4)
    dp(torch.zeros(1, 2))
    assert threads == [threading.current_thread()]
    with pytest.raises(KeyError, match="empty"):
        dp(torch.zeros(0, 2))


def test_replicas_sharing_a_device_run_inline_one_after_another():
    order = []

    class M(nn.Module):
        def forward(self, x):
            order.append((threading.current_thread(), x[0].item()))
            return x

    dpfast.DataParallel(M(), ["cpu"] * 4)(torch.arange(8.0))
    assert order == [(threading.current_thread(), float(k)) for k in (0, 2, 4, 6)]


def test_replicas_run_in_threads_with_grad_inference_and_autocast_state():
    """At a collective the replicas of a device take turns on threads of their own: each carries the caller's
    grad mode, inference mode and autocast state."""
    seen = []

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            dpfast.all_reduce(y.sum())  # hands the turn to the next replica, on a thread of its own
            seen.append(
                (threading.current_thread().name, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), y.dtype)
            )
            return y

    dp = dpfast.DataParallel(M(), ["cpu"] * 3)
    x = torch.randn(6, 4)
    assert dp(x).requires_grad
    assert (
        len({s[0] for s in seen}) == 3
        and all(  # one thread per replica (names: idents get reused)
            s[1:] == (True, False, torch.float32) for s in seen
        )
    )
    seen.clear()
    with torch.no_grad():
        assert not dp(x).requires_grad
    assert all(s[1:] == (False, False, torch.float32) for s in seen)
    seen.clear()
    with torch.inference_mode():
        dp(x)
    assert all(s[1:] == (False, True, torch.float32) for s in seen)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dp(x).dtype == torch.bfloat16
    assert all(s[1:] == (True, False, torch.bfloat16) for s in seen)
    seen.clear()
    dp(x)
    assert all(s[3] == torch.float32 for s in seen)  # the autocast state did not leak into the workers


def test_replicas_on_worker_threads_use_the_callers_intra_op_thread_count():
    """Was: after ``torch.set_num_threads(1)`` the replicas on persistent workers kept the count they started
    with (2 here), while replica 0, in the caller's thread, had 1."""

    class M(nn.Module):
        def forward(self, x):
            n = torch.get_num_threads()
            dpfast.all_reduce(x.sum())  # the replicas take turns on workers of their own
            return x * n

    dp = dpfast.DataParallel(M(), ["cpu"] * 3)
    before = torch.get_num_threads()
    try:
        for n in (2, 1, 3, 1):
            torch.set_num_threads(n)
            assert dp(torch.ones(3, 1)).flatten().tolist() == [n] * 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(
    not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
    reason="passing saved-tensor hooks to worker threads needs torch >= 2.8 (older torch: a warning, "
    "tests/test_torch_version_fallbacks.py)",
)
def test_saved_tensor_hooks_reach_every_replica():
    """save_on_cpu-style hooks set around the call apply in the worker threads too, and only during the call."""
    packed = []

    def pack(t):
        packed.append(threading.current_thread().name)
        return t.clone()  # a copy, as an offloading hook would make

    class TakingTurns(nn.Sequential):
        def forward(self, x):
            dpfast.all_reduce(x.sum())  # replicas then run on threads of their own
            return super().forward(x)

    torch.manual_seed(0)
    module = TakingTurns(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    dp = dpfast.DataParallel(module, ["cpu"] * 3)
    x = torch.randn(9, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dp(x)
    assert len(set(packed)) == 3  # the caller and both workers packed their replicas' saved tensors
    out.square().sum().backward()
    got = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(x).square().sum().backward()
    for g, p in zip(got, module.parameters()):
        torch.testing.assert_close(g, p.grad)
    packed.clear()
    dp(x)
    assert packed == []  # the hooks did not stay behind in the workers


def test_replica_key_error_keeps_its_type():
    """A KeyError in a replica (str(KeyError(m)) is repr(m)) came back as a RuntimeError, unlike torch's
    parallel_apply, so `except KeyError` around the call stopped working."""

    class M(nn.Module):
        def forward(self, x):
            return {"a": x}["b"]

    with pytest.raises(KeyError, match="replica 0 on cpu raised KeyError: 'b'") as e:
        dpfast.DataParallel(M(), ["cpu"] * 2)(torch.zeros(4))
    assert isinstance(e.value.__cause__, KeyError)


# ---- the worker pool ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_gets_a_working_pool_even_if_the_lock_was_held():
    """A fork while another thread holds the pool's lock must not leave the child's pool locked forever."""
    import time

    from dpfast.run.workers import WorkerPool

    pool = WorkerPool(name="fork-test")
    done = threading.Event()
    pool.submit(lambda: None, done)  # the parent has a worker
    assert done.wait(5)
    with pool._lock:  # as if a worker were releasing itself at the moment of the fork
        pid = os.fork()
        if pid == 0:  # child: one thread; the parent's workers do not exist here
            try:
                ran = threading.Event()
                pool.submit(ran.set, threading.Event())
                os._exit(0 if ran.wait(5) and len(pool.threads()) == 1 else 1)
            except BaseException:
                os._exit(2)
    deadline = time.monotonic() + 20
    while True:
        waited, status = os.waitpid(pid, os.WNOHANG)
        if waited:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the pool's lock")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    pool.shutdown()


# ---- injected faults ----------------------------------------------------------------------------------------------


class InjectedFault(RuntimeError):
    pass


class FailEveryK(nn.Module):
    """Column 0 of ``x`` holds the sample id; the replica whose chunk holds sample ``target`` raises on every k-th
    call it makes, in forward or (through a custom autograd function) in backward."""

    def __init__(self, k: int, target: int, where: str):
        super().__init__()
        self.mlp = MLP(5, 2, hidden=8)
        self.k, self.target, self.where = k, target, where
        # calls by the target replica only; a dict, shared by reference with the replicas (an int attribute set
        # by a replica's forward is the replica's own and undone at the next call, as on another GPU)
        self.counter = {"calls": 0}
        self.lock = threading.Lock()

    def forward(self, x):
        y = self.mlp(x)
        if (x[:, 0] == self.target).any():
            with self.lock:
                self.counter["calls"] += 1
                calls = self.counter["calls"]
                fail = calls % self.k == 0
            if fail and self.where == "forward":
                raise InjectedFault(f"injected forward fault on call {calls}")
            if fail and self.where == "backward":
                y = _FailInBackward.apply(y, f"injected backward fault on call {calls}")
        return y


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, message):
        ctx.message = message
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise InjectedFault(ctx.message)


def _batch(step: int, n_rows: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n_rows, 5, generator=g, dtype=DT)
    x[:, 0] = torch.arange(n_rows, dtype=DT)
    return x


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fault_every_kth_call_on_one_replica_then_next_step_succeeds(where):
    torch.manual_seed(0)
    module = FailEveryK(k=3, target=4, where=where).to(DT)  # sample 4: replica 1 of chunks [3, 2, 2]
    plain = copy.deepcopy(module.mlp)
    dp = dpfast.DataParallel(module, ["cpu"] * 3)
    threads_before = threading.active_count()
    failures = 0
    for step in range(12):
        x = _batch(step)
        module.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        fails = (step + 1) % 3 == 0
        if fails and where == "forward":
            with pytest.raises(InjectedFault) as e:
                dp(x)
            # the error names the replica and device, the original is chained with its traceback
            assert str(e.value) == f"replica 1 on cpu raised InjectedFault: injected forward fault on call {step + 1}"
            assert type(e.value.__cause__) is InjectedFault and e.value.__cause__.__traceback__ is not None
            failures += 1
            continue
        out = dp(x)
        loss = (out * out).sum()
        if fails:
            # backward runs in torch's autograd engine, not in dpfast: the original exception arrives unchanged
            with pytest.raises(InjectedFault, match=f"^injected backward fault on call {step + 1}$"):
                loss.backward()
            failures += 1
            continue
        loss.backward()
        ref = plain(x)
        (ref * ref).sum().backward()
        torch.testing.assert_close(out, ref)  # the step after a failure is as good as any other
        for p, q in zip(module.mlp.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert threading.active_count() <= threads_before + 2  # at most the two pool workers this call needed
    assert failures == 4


@pytest.mark.usefixtures("one_thread")
def test_every_replica_failing_at_once_and_nothing_left_running():
    class AllFail(nn.Module):
        def forward(self, x):
            raise InjectedFault(f"chunk of {x.shape[0]}")

    dp = dpfast.DataParallel(AllFail(), ["cpu"] * 4)
    before = threading.active_count()
    for _ in range(20):
        with pytest.raises(
            InjectedFault,
            match=r"^replica 0 on cpu raised InjectedFault: chunk of 3 \(3 other "
            r"replicas failed too\)$",
        ):
            dp(torch.zeros(10))
    assert threading.active_count() <= before + 3
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("dpfast-worker"))


@pytest.mark.usefixtures("one_thread")
def test_failed_step_frees_the_other_replicas_outputs_without_gc():
    kept = []

    class FailOnLast(nn.Module):
        def forward(self, x):
            y = x * 2
            kept.append(weakref.ref(y))
            if x[0] == 4:
                raise InjectedFault("last replica fails")
            return y

    dp = dpfast.DataParallel(FailOnLast(), ["cpu"] * 3)
    gc.collect()
    gc.disable()
    try:
        with contextlib.suppress(InjectedFault):
            dp(torch.arange(6.0).requires_grad_())
        assert len(kept) == 3 and all(r() is None for r in kept)  # freed by reference counting alone
    finally:
        gc.enable()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.cuda
def test_cuda_failing_replica_leaves_no_stream_waiting():
    torch.manual_seed(0)
    module = FailEveryK(k=2, target=4, where="forward").to(DT).cuda()
    plain = copy.deepcopy(module.mlp)
    dp = dpfast.DataParallel(module, [0, 0, 0])
    side = torch.cuda.Stream()
    for step in range(6):
        x = _batch(step).cuda()
        with torch.cuda.stream(side):
            if (step + 1) % 2 == 0:
                with pytest.raises(InjectedFault, match=r"^replica 1 on cuda:0 raised InjectedFault"):
                    dp(x)
            else:
                out = dp(x)
                torch.testing.assert_close(out, plain(x))
        side.synchronize()
        assert side.query() and torch.cuda.current_stream().query()
        event = torch.cuda.Event()
        event.record(side)
        event.synchronize()
        assert event.query()
    torch.cuda.synchronize()
