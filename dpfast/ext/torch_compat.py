"""Torch features dpfast uses that older torch releases lack, detected where they are used; and dynamo's disable
without importing dynamo (:func:`run_by_dynamo_as_it_is`).

Each feature missing from the running torch degrades with a warning at the moment it matters, never silently;
README.md ("Supported torch versions") lists which torch each needs.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

import torch

SAVED_TENSORS_HOOKS_TORCH = "2.8"  # the first torch with torch._C._autograd._top_saved_tensors_default_hooks


def warn_saved_tensors_hooks_unreadable() -> None:
    """On a torch that cannot return a thread's saved-tensor hooks, a worker thread runs a replica without the
    hooks set around the call: say so (``save_on_cpu()`` around the call then covers only the replicas that run in
    the calling thread, the first device's while no collective makes them take turns on threads)."""
    warnings.warn(
        "dpfast: saved-tensor hooks (torch.autograd.graph.save_on_cpu() or saved_tensors_hooks) are set around "
        f"this multi-replica call, but torch {torch.__version__} cannot read them for the replicas' worker "
        "threads, so they apply only to the replicas in the calling thread. Passing them on needs torch >= "
        f"{SAVED_TENSORS_HOOKS_TORCH}; with this torch, enter them inside the module's forward instead (each "
        "replica then sets its own).",
        RuntimeWarning,
        stacklevel=5,
    )


def saved_tensors_hooks_set() -> bool:
    """Whether default saved-tensor hooks are set in this thread, on any torch: a saved tensor packed by them
    refuses a second pair of hooks. (The probe's one tiny tensor goes through the pack hook.)"""
    probe = torch.ones((), requires_grad=True).sin()
    try:
        probe.grad_fn._raw_saved_self.register_hooks(lambda t: t, lambda t: t)
    except RuntimeError:
        return True
    return False


def run_by_dynamo_as_it_is(fn: Callable) -> Callable:
    """``fn`` as ``torch.compiler.disable`` makes it: dynamo runs it as it is, a graph break in a compiled caller (a
    call's replicas run on worker threads and are leased to the outputs' autograd graph, which tracing cannot hold:
    docs/guides/compile-and-threads.md). Without importing dynamo (over a second, sympy included) until something
    else has: until then nothing can be compiling."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    run._torchdynamo_disable = True  # type: ignore[attr-defined]  # (dynamo's tracer: break here, do not inline)
    return run
