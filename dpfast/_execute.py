"""Run the replicas concurrently, like ``torch.nn.parallel.parallel_apply``, on a persistent worker pool.

Grad mode, inference mode, autocast, saved-tensor hooks (``torch.autograd.graph.save_on_cpu`` and the like) and
each CUDA device's current stream are thread-local in PyTorch, so they are read in the caller and re-entered in the
worker for each task (and left when it ends, so nothing leaks into the next task). Replica 0 runs in the calling
thread (one thread fewer, and its state is the caller's own). A single replica runs inline and its exceptions
propagate unchanged.

Why a pool: torch's parallel_apply starts fresh threads every step, and a fresh thread pays for its first ATen
call (intra-op thread-pool setup): measured here, ~3 ms per step for two replicas of a small Linear against
~0.2 ms on reused threads. Workers are daemon threads that sit idle between calls; a call returns or raises only
after every one of its tasks has finished, so no work is ever left running behind it.

Each ``DataParallel`` owns a :class:`_Pool` that keeps at most one idle worker per device slot after the first
(slot 0 runs in the caller). It grows past that only while all its workers are busy (the same instance called from
several threads at once, or nested calls), so it cannot deadlock, and the extra workers exit when their task ends.
Workers hold only a weak reference to their pool: when the owner is deleted the pool is collected and its
finalizer stops the idle workers (and, via ``weakref.finalize``'s exit hook, at interpreter exit). A pool is per
process: after a fork it starts afresh.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn


class _State:
    """The caller's thread-local execution state, to re-enter in a worker."""

    def __init__(self, devices: Sequence[torch.device]):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast: dict[str, tuple[torch.dtype, bool]] = {}
        for dtype in sorted({d.type for d in devices}):
            st = _autocast_state(dtype)
            if st is not None:
                self.autocast[dtype] = st
        self.saved_tensors_hooks = _saved_tensors_hooks()
        self.streams: dict[torch.device, Any] = {}
        for d in devices:
            if d.type == "cuda" and d not in self.streams:
                self.streams[d] = torch.cuda.current_stream(d)

    def enter(self, device: torch.device, stack: contextlib.ExitStack) -> None:
        if self.inference:
            stack.enter_context(torch.inference_mode())
        else:
            stack.enter_context(torch.set_grad_enabled(self.grad))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(self.streams[device]))
        for dtype, (adtype, cache) in self.autocast.items():
            stack.enter_context(torch.autocast(dtype, dtype=adtype, enabled=True, cache_enabled=cache))
        if self.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_tensors_hooks))


def _saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost ``(pack, unpack)`` saved-tensor hooks of this thread (the only ones that apply), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # torch < 2.8 cannot say which hooks are set: the replicas run without them, with a warning
        from ._compat import warn_if_saved_tensors_hooks_set

        warn_if_saved_tensors_hooks_set()
        return None
    return top(False)


def _autocast_state(device_type: str) -> tuple[torch.dtype, bool] | None:
    """``(dtype, cache_enabled)`` when autocast is on for ``device_type`` in this thread, else None."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4 API
        if device_type == "cuda":
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
        elif device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        else:
            return None
    if not enabled:
        return None
    return dtype, torch.is_autocast_cache_enabled()


def _wrap(exc: BaseException, index: int, device: torch.device, n_failed: int) -> BaseException:
    """An exception of the same type (when it can be built from a message) naming the replica and device."""
    others = f" ({n_failed - 1} other replica{'s' if n_failed > 2 else ''} failed too)" if n_failed > 1 else ""
    msg = f"replica {index} on {device} raised {type(exc).__name__}: {exc}{others}"
    try:
        new = type(exc)(msg)
        # args, not str(): str(KeyError(m)) is repr(m), yet a KeyError must stay a KeyError (as in torch)
        if isinstance(new, type(exc)) and new.args == (msg,):
            return new
    except Exception:
        pass
    return RuntimeError(msg)


def run_replicas(
    modules: Sequence[nn.Module],
    inputs: Sequence[tuple[tuple, dict]],
    devices: Sequence[torch.device],
    pool: _Pool | None = None,
) -> list[Any]:
    """``modules[i](*inputs[i][0], **inputs[i][1])`` for every ``i``, concurrently; results in replica order."""
    n = len(modules)
    if n == 1:
        args, kwargs = inputs[0]
        with torch.cuda.device(devices[0]) if devices[0].type == "cuda" else contextlib.nullcontext():
            return [modules[0](*args, **kwargs)]
    state = _State(devices)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def work(i: int) -> None:
        try:
            with contextlib.ExitStack() as stack:
                state.enter(devices[i], stack)
                args, kwargs = inputs[i]
                results[i] = modules[i](*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[i] = exc

    done = [threading.Event() for _ in range(1, n)]
    started = 0
    if pool is None:
        pool = _POOL
    try:
        for i in range(1, n):
            pool.submit(lambda i=i: work(i), done[i - 1])
            started += 1
        work(0)
    finally:
        interrupted: BaseException | None = None
        for ev in done[:started]:
            while not ev.is_set():  # wait even if the caller is interrupted while waiting, then re-raise that
                try:
                    ev.wait()
                except KeyboardInterrupt as exc:  # pragma: no cover
                    interrupted = exc
        if interrupted is not None:  # pragma: no cover
            raise interrupted
    failed = [i for i in range(n) if errors[i] is not None]
    if failed:
        i = failed[0]
        exc = errors[i]
        assert exc is not None
        # The original's traceback holds work()'s frame, whose closure holds these lists: empty them so the
        # exception -> traceback -> frame -> list -> exception cycle cannot keep the other replicas' outputs (and
        # their autograd graphs) alive until the garbage collector runs.
        errors.clear()
        results.clear()
        raise _wrap(exc, i, devices[i], len(failed)) from exc
    return results


# ---------------------------------------------------------------------------------------------------------------
# The worker pool
# ---------------------------------------------------------------------------------------------------------------


class _Worker(threading.Thread):
    def __init__(self, pool: _Pool, name: str):
        super().__init__(name=name, daemon=True)
        self.pool = weakref.ref(pool)  # the owner's deletion must be able to collect the pool
        self.tasks: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            item = self.tasks.get()
            if item is None:
                return
            fn, done = item
            item = None
            try:
                fn()
            except BaseException:  # pragma: no cover - run_replicas' work() stores every exception itself
                pass
            finally:
                fn = None  # the task's closure (its inputs and outputs) must not stay alive in an idle worker
                pool = self.pool()
                keep = pool is not None and pool._release(self)
                pool = None
                done.set()
            if not keep:
                return


def _stop(workers: list) -> None:
    """Finalizer of a pool: tell its idle workers to exit (busy ones exit when their task ends)."""
    for w in list(workers):
        w.tasks.put(None)
    me = threading.current_thread()
    for w in list(workers):
        if w is not me and w.is_alive():
            w.join(timeout=1.0)


class _Pool:
    """Idle workers are reused; a new one starts only when none is idle. At most ``max_idle`` are kept."""

    def __init__(self, max_idle: int = 32, name: str = "dpfast-worker"):
        self.max_idle = max_idle
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._pid = os.getpid()
        self._count = 0
        self._finalizer = weakref.finalize(self, _stop, self._idle)

    def __reduce__(self):  # deepcopy / pickle of the owning DataParallel: a fresh pool, no threads
        return (_Pool, (self.max_idle, self.name))

    def _after_fork(self) -> None:
        """In a forked child the parent's workers do not exist, and the lock may have been held by one of them at
        the fork (it would then stay locked forever here): start afresh. The child runs one thread at this point."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._idle.clear()  # the same list object: the finalizer holds it
            self._all.clear()
            self._pid = os.getpid()

    def threads(self) -> list[_Worker]:
        """The live workers (tests read it)."""
        self._after_fork()
        with self._lock:
            return [w for w in self._all if w.is_alive()]

    def submit(self, fn: Callable[[], None], done: threading.Event) -> None:
        self._after_fork()
        with self._lock:
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                self._count += 1
                worker = _Worker(self, f"{self.name}-{self._count}")
                self._all.append(worker)
                worker.start()
        worker.tasks.put((fn, done))

    def _release(self, worker: _Worker) -> bool:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < self.max_idle and self._finalizer.alive:
                self._idle.append(worker)
                return True
            if worker in self._all:
                self._all.remove(worker)
            return False

    def shutdown(self) -> None:
        """Stop the idle workers now (the pool starts new ones on its next call)."""
        self._after_fork()
        with self._lock:
            idle = list(self._idle)
            self._idle.clear()
            for w in idle:
                self._all.remove(w)
        _stop(idle)


_POOL = _Pool()  # for callers without a pool of their own
atexit.register(_POOL.shutdown)
