"""Run the replicas concurrently, like ``torch.nn.parallel.parallel_apply``.

Grad mode, inference mode, autocast and each CUDA device's current stream are thread-local in PyTorch, so they are
read in the caller and re-entered in every worker. Replica 0 runs in the calling thread (one thread fewer, and its
state is the caller's own); the others run in threads that are always joined before this returns or raises, so no
thread is left behind. A single replica runs inline and its exceptions propagate unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional, Sequence

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


def _autocast_state(device_type: str) -> Optional[tuple[torch.dtype, bool]]:
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
        if isinstance(new, type(exc)) and str(new) == msg:
            return new
    except Exception:
        pass
    return RuntimeError(msg)


def run_replicas(
    modules: Sequence[nn.Module], inputs: Sequence[tuple[tuple, dict]], devices: Sequence[torch.device]
) -> list[Any]:
    """``modules[i](*inputs[i][0], **inputs[i][1])`` for every ``i``, concurrently; results in replica order."""
    n = len(modules)
    if n == 1:
        args, kwargs = inputs[0]
        with torch.cuda.device(devices[0]) if devices[0].type == "cuda" else contextlib.nullcontext():
            return [modules[0](*args, **kwargs)]
    state = _State(devices)
    results: list[Any] = [None] * n
    errors: list[Optional[BaseException]] = [None] * n

    def work(i: int) -> None:
        try:
            with contextlib.ExitStack() as stack:
                state.enter(devices[i], stack)
                args, kwargs = inputs[i]
                results[i] = modules[i](*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,), name=f"dpfast-replica-{i}", daemon=True) for i in range(1, n)]
    try:
        for t in threads:
            t.start()
        work(0)
    finally:
        interrupted: Optional[BaseException] = None
        for t in threads:
            while t.is_alive():  # join even if the caller is interrupted while waiting, then re-raise that
                try:
                    t.join()
                except KeyboardInterrupt as exc:  # pragma: no cover
                    interrupted = exc
        if interrupted is not None:  # pragma: no cover
            raise interrupted
    failed = [i for i in range(n) if errors[i] is not None]
    if failed:
        i = failed[0]
        exc = errors[i]
        assert exc is not None
        raise _wrap(exc, i, devices[i], len(failed)) from exc
    return results
