"""The C++ comm hook behind DistributedDataParallel's per-step check (csrc/ddp_check_hook.cpp): its entry points
refuse what is not theirs with a Python error, never a crash. What the hook does on a group of ranks is in
tests/test_distributed_checks.py (every scenario there runs on it, and on the Python hook it stands in for)."""

from __future__ import annotations

import pytest
import torch

from dpfast.ext import loader

C = loader.C
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "_ddp_check_install"), reason="needs the extension")


@pytest.mark.parametrize("entry", ["_ddp_check_read", "_ddp_check_collectives"])
@pytest.mark.parametrize("state", [None, 5, object(), torch.zeros(1)])
def test_a_state_that_is_not_one_is_refused(entry, state):
    with pytest.raises((TypeError, ValueError)):
        getattr(C, entry)(state)


def test_delegate_refuses_a_state_that_is_not_one():
    with pytest.raises((TypeError, ValueError)):
        C._ddp_check_delegate(object(), lambda state, bucket: None)


@pytest.mark.parametrize(
    "args, error",
    [
        ((object(), object(), 0, 1, len, len), RuntimeError),  # no reducer, no process group
        ((object(), object(), 2, 2, len, len), ValueError),  # rank past the world
        ((object(), object(), -1, 2, len, len), ValueError),
        ((object(), object(), 0, 0, len, len), ValueError),
        ((object(), object(), 0, 1, 5, len), TypeError),  # not callables
        ((object(), object(), 0, 1 << 70, len, len), OverflowError),
        ((object(),), TypeError),
    ],
)
def test_install_refuses_what_is_not_a_reducer_and_group(args, error):
    with pytest.raises(error):
        C._ddp_check_install(*args)
