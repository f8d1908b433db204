"""Shared test fixtures: device parametrization, the `cuda` marker (skipped without a GPU), and a check that every
DataParallel call in the suite does what its plan() says."""

from __future__ import annotations

import threading

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


# ---- plan() and the call cannot disagree ---------------------------------------------------------------------------

_PLAN_CHECK = threading.local()
PLAN_CHECKS = {"calls": 0}


def _record(key, value):
    rec = getattr(_PLAN_CHECK, "rec", None)
    if rec is not None and key not in rec:
        rec[key] = value


def _compare(plan, rec):
    replicas = plan.replicas
    if plan.mode == "direct":
        assert "run_devices" not in rec and "sizes" not in rec, (plan.mode, rec)
    elif plan.mode == "once":
        assert "sizes" not in rec and rec.get("run_devices") == [plan.devices[0]], (str(plan), rec)
    else:
        assert rec.get("sizes") == [s for _, _, s in replicas], (str(plan), rec)
        assert rec.get("scatter_devices") == rec.get("run_devices") == [d for _, d, _ in replicas], (str(plan), rec)


@pytest.fixture(autouse=True)
def plan_matches_call(request, monkeypatch):
    """Every DataParallel call in every test also gets its plan() first; the call must then raise what plan() raised,
    or scatter with the plan's chunk sizes onto the plan's devices and run replicas exactly there."""
    if "no_plan_check" in request.keywords:
        yield
        return
    from dpfast import data_parallel
    from dpfast.ext.torch_compat import run_by_dynamo_as_it_is

    real_forward = data_parallel.DataParallel.forward
    real_scatter = data_parallel.scatter_tree
    real_run = data_parallel.run_replicas

    def scatter_tree(tree, sizes, devices):
        _record("sizes", list(sizes))
        _record("scatter_devices", list(devices))
        return real_scatter(tree, sizes, devices)

    def run_replicas(modules, inputs, devices, *args, **kwargs):
        _record("run_devices", list(devices))
        return real_run(modules, inputs, devices, *args, **kwargs)

    def forward(self, *args, **kwargs):
        if not self._devices:
            return real_forward(self, *args, **kwargs)
        try:
            plan, plan_error = self.plan(*args, **kwargs), None
        except Exception as exc:  # noqa: BLE001 - the call must raise the same
            plan, plan_error = None, exc
        outer, _PLAN_CHECK.rec = getattr(_PLAN_CHECK, "rec", None), {}
        try:
            out = real_forward(self, *args, **kwargs)
        except Exception as exc:
            if plan_error is not None:
                assert (type(exc), str(exc)) == (type(plan_error), str(plan_error)), "plan() and the call raise apart"
            raise
        finally:
            rec, _PLAN_CHECK.rec = _PLAN_CHECK.rec, outer
        assert plan_error is None, f"plan() raised {plan_error!r} but the call ran"
        _compare(plan, rec)
        PLAN_CHECKS["calls"] += 1
        return out

    monkeypatch.setattr(data_parallel, "scatter_tree", scatter_tree)
    monkeypatch.setattr(data_parallel, "run_replicas", run_replicas)
    # as the real forward is: dynamo runs the call as it is (its checks here too)
    monkeypatch.setattr(data_parallel.DataParallel, "forward", run_by_dynamo_as_it_is(forward))
    yield


def pytest_terminal_summary(terminalreporter):
    if PLAN_CHECKS["calls"]:
        terminalreporter.write_line(f"plan() checked against {PLAN_CHECKS['calls']} DataParallel calls")
