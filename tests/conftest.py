"""Shared test fixtures: device parametrization and the `cuda` marker (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every test that takes `device` runs on cpu, and on cuda where one exists."""
    return request.param


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add OpenMP wake-ups, which on a busy 2-core machine made a 3-layer GRU
    step ~100x slower. Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`; the setting is
    restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
