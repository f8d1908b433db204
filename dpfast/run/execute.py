"""Run a call's replicas, like ``torch.nn.parallel.parallel_apply``: replicas on different devices concurrently,
replicas sharing a device one at a time (:mod:`dpfast.run.rendezvous`), so a rehearsal on one device runs inline.

Grad mode, inference mode, autocast, saved-tensor hooks (``torch.autograd.graph.save_on_cpu`` and the like), each
CUDA device's current stream and the intra-op thread count (``torch.set_num_threads``: OpenMP keeps one per thread)
are thread-local in PyTorch, so they are read in the caller and re-entered in each worker task (and left when it
ends, so nothing leaks into the next task; a worker's thread count is set again by the next call). Worker threads
come from the caller's :class:`~dpfast.run.workers.WorkerPool` (torch's parallel_apply starts fresh threads every
step, and a fresh thread pays for its first ATen call; benchmarks/RESULTS.md has the figures). A call returns or
raises only after every one of its tasks has finished, so no work is left running behind it. A single replica runs
inline and its exceptions propagate unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from .collectives import check_collective
from .rendezvous import Call, solo_context
from .workers import WorkerPool

if TYPE_CHECKING:
    from .write_watch import WriteWatch


class _CallerContext:
    """The caller's thread-local execution context (grad mode, autocast, intra-op threads, streams...), to re-enter
    in a worker."""

    def __init__(self, devices: Sequence[torch.device]):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.threads = torch.get_num_threads()  # (OpenMP's count is per thread: a worker keeps its own otherwise)
        self.autocast: dict[str, tuple[torch.dtype, bool]] = {}
        types = _device_kinds(tuple(devices))[0]
        for dtype in types:
            st = _autocast_state(dtype)
            if st is not None:
                self.autocast[dtype] = st
        self.saved_tensors_hooks, self.hooks_unreadable = _saved_tensors_hooks()
        self.streams: dict[torch.device, Any] = {}
        if "cuda" in types:
            for d in devices:
                if d.type == "cuda" and d not in self.streams:
                    self.streams[d] = torch.cuda.current_stream(d)

    def enter(self, device: torch.device, stack: contextlib.ExitStack) -> None:
        if torch.get_num_threads() != self.threads:  # (a worker of ours: left so until the next call's)
            torch.set_num_threads(self.threads)
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


_TOP_SAVED_TENSORS_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch >= 2.8


def _saved_tensors_hooks() -> tuple[tuple[Callable, Callable] | None, bool]:
    """The innermost ``(pack, unpack)`` saved-tensor hooks of this thread (the only ones that apply), or None; and
    whether some are set that this torch cannot read (< 2.8: the workers then run without them, with a warning)."""
    top = _TOP_SAVED_TENSORS_HOOKS
    if top is None:
        from ..ext.torch_compat import saved_tensors_hooks_set

        return None, torch.is_grad_enabled() and saved_tensors_hooks_set()
    return top(False), False


def _autocast_state(device_type: str) -> tuple[torch.dtype, bool] | None:
    """``(dtype, cache_enabled)`` when autocast is on for ``device_type`` in this thread, else None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


def _wrap(exc: BaseException, index: int, device: torch.device, n_failed: int, hint: str = "") -> BaseException:
    """An exception of the same type (when it can be built from a message) naming the replica and device."""
    others = f" ({n_failed - 1} other replica{'s' if n_failed > 2 else ''} failed too)" if n_failed > 1 else ""
    msg = f"replica {index} on {device} raised {type(exc).__name__}: {exc}{others}{hint}"
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
    pool: WorkerPool | None = None,
    watch: WriteWatch | None = None,
    hint: Callable[[], str] | None = None,
) -> list[Any]:
    """``modules[i](*inputs[i][0], **inputs[i][1])`` for every ``i``; results in replica order.

    Replicas on different devices run concurrently; replicas sharing a device take turns (see
    :mod:`dpfast.run.rendezvous`), so a rehearsal on one device is deterministic and runs inline. ``watch`` is told
    when each replica's turn ends (:mod:`dpfast.run.write_watch`). A ``KeyboardInterrupt`` (any ``BaseException``
    that is not an ``Exception``) stops the call: no replica starts after it, and it is re-raised as it is.
    ``hint()`` is what a replica's re-raised error adds about the call's arguments (read only then).
    """
    n = len(modules)
    if n == 1:
        args, kwargs = inputs[0]
        with _device_guard(devices[0]), solo_context():
            return [modules[0](*args, **kwargs)]
    if pool is None:
        raise ValueError("run_replicas: several replicas need a WorkerPool to run on")
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    # Read here, in the caller, before any replica runs: a worker started later (at a collective) must not take
    # the state of the replica that handed it the turn (a no_grad or autocast block around that collective).
    context = _CallerContext(devices)
    tasks: list[threading.Event] = []

    on_cuda = _device_kinds(tuple(devices))[1]

    def run(i: int) -> BaseException | None:
        try:
            args, kwargs = inputs[i]
            if on_cuda[i]:
                with torch.cuda.device(devices[i]):
                    results[i] = modules[i](*args, **kwargs)
            else:  # (a rehearsal's replicas: no guard to enter)
                results[i] = modules[i](*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[i] = exc
        # (returned from outside the except clause: a frame that still named the exception would form a cycle
        # with its traceback, and keep this replica's outputs alive until the garbage collector runs)
        return errors[i]

    call = Call(devices, run, _spawner(pool, context, tasks), check_collective, watch and watch.turn_ended)
    try:
        call.run_all()
    finally:
        _wait_all(tasks)
    if watch is not None:
        watch.report()
    if tasks and context.hooks_unreadable:  # some replicas ran on workers, without the caller's hooks
        from ..ext.torch_compat import warn_saved_tensors_hooks_unreadable

        warn_saved_tensors_hooks_unreadable()
    for j in call.start_errors:  # (no local names an exception: the raised one's traceback holds this frame)
        errors[j] = call.start_errors[j]
    if any(e is not None for e in errors):
        results.clear()  # the exception's traceback holds run()'s frame, whose closure holds these lists
        _raise_first(errors, devices, hint)
    return results


@functools.lru_cache(maxsize=64)
def _device_kinds(devices: tuple[torch.device, ...]) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """A device list's distinct types, sorted, and whether each entry is a CUDA device (read once per list)."""
    return tuple(sorted({d.type for d in devices})), tuple(d.type == "cuda" for d in devices)


def _spawner(pool: WorkerPool, context: _CallerContext, tasks: list[threading.Event]) -> Callable:
    """``spawn(fn, device)`` for the rendezvous: ``fn`` on a pool worker, in the caller's context for ``device``."""

    def spawn(fn: Callable[[], None], device: torch.device) -> None:
        def task() -> None:
            with contextlib.ExitStack() as stack:
                context.enter(device, stack)
                fn()

        done = threading.Event()
        pool.submit(task, done)  # (if no thread can be started this raises, and the rendezvous fails the replica)
        tasks.append(done)

    return spawn


def _raise_first(
    errors: list[BaseException | None], devices: Sequence[torch.device], hint: Callable[[], str] | None = None
) -> None:
    """Raise the root cause: an interrupt as it was raised, else a replica's own exception (over the collective
    errors it caused in the others) naming the replica and device, chained to the original."""
    n = len(errors)
    stops = [i for i in range(n) if errors[i] is not None and not isinstance(errors[i], Exception)]
    primary = [i for i in range(n) if errors[i] is not None and not getattr(errors[i], "secondary", False)]
    failed = stops or primary or [i for i in range(n) if errors[i] is not None]
    i = failed[0]
    exc = errors[i]
    assert exc is not None
    # The original's traceback holds run()'s frame, whose closure holds the call's lists: empty them so the
    # exception -> traceback -> frame -> list -> exception cycle cannot keep the other replicas' outputs (and
    # their autograd graphs) alive until the garbage collector runs.
    errors.clear()
    try:
        if stops:  # KeyboardInterrupt, SystemExit...: as it was raised (a wrapped SystemExit changes the exit)
            raise exc
        raise _wrap(exc, i, devices[i], len(failed), hint() if hint is not None else "") from exc
    finally:
        del exc  # the traceback keeps this frame: it must not name the exception (a cycle, as above)


def _device_guard(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _wait_all(tasks: Sequence[threading.Event]) -> None:
    """Wait for every worker task (no replica starts once the call is interrupted, so this waits only for the
    forwards already running). A Ctrl-C while waiting stops the wait: the caller gets it at once, and the
    replicas still running finish on their own (the call's replica set is then never reused)."""
    for ev in list(tasks):
        ev.wait()
