"""Features that need a newer torch than the oldest supported (2.4) degrade with a warning, never silently."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import dpfast
from dpfast.ext import torch_compat as _compat
from dpfast.run import execute as _execute


@pytest.fixture
def without_query(monkeypatch):
    """This torch as if it were older than 2.8: no way to read the thread's saved-tensor hooks."""
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks", raising=False)
    monkeypatch.setattr(_execute, "_TOP_SAVED_TENSORS_HOOKS", None)  # (read once, when dpfast is imported)


class _TakingTurns(nn.Sequential):
    def forward(self, x):
        dpfast.all_reduce(x.sum())  # the replicas then take turns on worker threads of their own
        return super().forward(x)


def _dp_and_input():
    torch.manual_seed(0)
    module = _TakingTurns(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return dpfast.DataParallel(module, ["cpu"] * 3), torch.randn(9, 4)


def test_saved_tensor_hooks_that_cannot_be_passed_on_warn(without_query):
    dp, x = _dp_and_input()
    packed = []

    def pack(t):
        packed.append(threading.current_thread().name)
        return t

    warning = r"apply only to the replicas in the calling thread\. Passing them on needs torch >= 2\.8"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), pytest.warns(RuntimeWarning, match=warning):
        dp(x)
    assert set(packed) == {threading.current_thread().name}  # as the warning says: the calling thread's only
    with torch.autograd.graph.save_on_cpu(), pytest.warns(RuntimeWarning, match="in the calling thread"):
        dp(x)


def test_no_warning_without_hooks_or_without_grad(without_query):
    dp, x = _dp_and_input()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(x)  # no hooks set
        with torch.no_grad(), torch.autograd.graph.save_on_cpu():
            dp(x)  # nothing is saved for backward, so the hooks do not matter


def test_replicas_in_the_calling_thread_need_no_warning(without_query):
    """Replicas sharing a device run inline in the caller's thread, where its hooks apply: nothing to warn about."""
    dp = dpfast.DataParallel(nn.Linear(4, 2), ["cpu"] * 3)
    packed = []
    with (
        warnings.catch_warnings(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t),
    ):
        warnings.simplefilter("error")
        dp(torch.randn(9, 4))
    assert len(packed) >= 3  # every replica's saved tensors went through the hooks


def test_the_probe_sees_hooks_on_this_torch():
    assert not _compat.saved_tensors_hooks_set()
    with torch.autograd.graph.save_on_cpu():
        assert _compat.saved_tensors_hooks_set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _compat.saved_tensors_hooks_set()
    assert not _compat.saved_tensors_hooks_set()
