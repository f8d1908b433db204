"""Run the replicas concurrently, like ``torch.nn.parallel.parallel_apply``, on a persistent worker pool.

Grad mode, inference mode, autocast, saved-tensor hooks (``torch.autograd.graph.save_on_cpu`` and the like) and
each CUDA device's current stream are thread-local in PyTorch, so they are read in the caller and re-entered in the
worker for each task (and left when it ends, so nothing leaks into the next task). Replica 0 runs in the calling
thread (one thread fewer, and its state is the caller's own). A single replica runs inline and its exceptions
propagate unchanged.

The other replicas run on the caller's :class:`~dpfast._workers.WorkerPool` (torch's parallel_apply starts fresh
threads every step, and a fresh thread pays for its first ATen call; benchmarks/RESULTS.md has the figures). A
call returns or raises only after every one of its tasks has finished, so no work is left running behind it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from ._workers import WorkerPool


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
    if top is None:  # pragma: no cover - torch without the query: the replicas run without the caller's hooks
        return None
    return top(False)


def _autocast_state(device_type: str) -> tuple[torch.dtype, bool] | None:
    """``(dtype, cache_enabled)`` when autocast is on for ``device_type`` in this thread, else None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


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
    pool: WorkerPool | None = None,
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
        raise ValueError("run_replicas: several replicas need a WorkerPool to run on")
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
