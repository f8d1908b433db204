"""torch's own DDP tests (``torch/testing/_internal/distributed/distributed_test.py``, installed with torch), run
against torch's ``DistributedDataParallel`` and against dpfast's drop-in, on the CPU over 2 gloo ranks.

Most of those tests were written for one GPU per rank. In the ranks' processes (forked, one pair per test) this
module rehearses those CUDA calls on the CPU: tensors and modules asked onto a GPU stay on the CPU, the device
queries say there are enough GPUs, and ``device_ids``/``output_device`` are dropped for CPU modules. Both classes
run under the same rehearsal, so a test that the port itself breaks fails for both alike; the suite's claim is
relative: every test that torch's DDP passes here, dpfast's passes.

The drop-in is what a torch-DDP user writes with the import changed: ``inputs="per_rank"`` and every other setting
at its default (the per-step checks on).

``python tests/torch_ddp_suite.py`` runs both classes over :data:`TORCH_PASSES` (the suite's test does that);
``--all`` over every DDP test of torch's suite, to see which torch's own DDP passes here (``make torch-ddp-suite``);
``--tests a,b`` over those. It prints a line per test and exits 1 when dpfast's fails one that torch's passes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import types
import unittest

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="dpfast_torch_ddp_suite_"))
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")  # a hang fails instead of waiting 300 s

import torch
from torch import nn
from torch.testing._internal import common_distributed
from torch.testing._internal.distributed import distributed_test as dt

import dpfast

TORCH_DDP = nn.parallel.DistributedDataParallel


def _is_ddp_test(name: str) -> bool:
    return name.startswith(("test_DistributedDataParallel", "test_ddp_"))


DDP_TESTS = sorted(n for n in dir(dt.DistributedTest._DistTestBase) if _is_ddp_test(n))
common_distributed.TIMEOUT_OVERRIDE.clear()  # (400 s for some): a test that hangs here fails in 120 s

# The DDP tests that torch's own DDP passes here (torch 2.14, CPU, 2 gloo ranks; `make torch-ddp-suite` lists
# them anew). The others need what the CPU cannot rehearse (CUDA streams, AMP, SyncBatchNorm on GPUs, fork-unsafe
# compile) or are skipped by torch itself.
# fmt: off
TORCH_PASSES = (
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_ddp_broadcast_buffer", "test_ddp_broadcast_buffer_via_hook",
    "test_ddp_broadcast_buffers_deprecation_warning", "test_ddp_bucket_cap_mb_list", "test_ddp_buffer_hook_allreduce",
    "test_ddp_buffer_hook_allreduce_return_future", "test_ddp_build_debug_param_to_name_mapping",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad", "test_ddp_comm_hook_logging",
    "test_ddp_control_flow_different_across_ranks", "test_ddp_control_flow_same_across_ranks", "test_ddp_create_graph",
    "test_ddp_device_mesh_initialization", "test_ddp_forward_backward_hook", "test_ddp_grad_div_uneven_inputs",
    "test_ddp_hook_parity_allreduce", "test_ddp_hook_parity_allreduce_process_group",
    "test_ddp_hook_parity_post_localSGD", "test_ddp_hook_parity_powerSGD", "test_ddp_ignore_params_arg",
    "test_ddp_init_sync_buffers_with_forward_sync_buffers_false", "test_ddp_join_model_equivalence",
    "test_ddp_join_respects_forward_sync_buffers_false", "test_ddp_logging_data_cpu",
    "test_ddp_model_diff_num_params_across_ranks", "test_ddp_multiple_nested_unused_params_err_ignore_params",
    "test_ddp_multiple_nested_unused_params_error", "test_ddp_namedtuple", "test_ddp_new_tensor_in_fwd",
    "test_ddp_new_tensor_in_fwd_static_graph", "test_ddp_profiling_torch_profiler", "test_ddp_python_error_logged",
    "test_ddp_remove_autograd_hooks", "test_ddp_returns_tensor_with_no_grad", "test_ddp_shared_grad_acc_unused_params",
    "test_ddp_sink_noclone", "test_ddp_static_graph_nested_types", "test_ddp_sync_module_states",
    "test_ddp_uneven_input_exception", "test_ddp_uneven_input_join_disable",
    "test_ddp_unused_params_rebuild_buckets_exception", "test_ddp_zero_output_features",
)
# fmt: on


def _cpu(device: object) -> object:
    """Any GPU device spec (an index, ``"cuda:1"``, ``torch.device("cuda", 1)``) as the CPU; others unchanged."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _on_cpu(fn, positional: bool = True):
    """``fn`` with GPU device arguments (``device=``, and positional ones for ``.to``) read as the CPU."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return fn(*[_cpu(a) for a in args] if positional else args, **kwargs)

    return wrapper


_FACTORIES = ("tensor", "ones", "zeros", "empty", "rand", "randn", "randint", "full", "arange", "as_tensor")


def rehearse_cuda_on_cpu(world_size: int) -> None:
    """Patch this process (a rank) so that the GPU tests' CUDA calls run on the CPU."""
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: max(8, world_size)
    cuda.current_device = lambda: 0
    for name in ("set_device", "synchronize", "manual_seed", "manual_seed_all", "empty_cache"):
        setattr(cuda, name, lambda *a, **k: None)
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.to = _on_cpu(torch.Tensor.to)  # type: ignore[method-assign]
    nn.Module.to = _on_cpu(nn.Module.to)  # type: ignore[method-assign]
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name), positional=False))


def _cpu_module_kwargs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """torch refuses ``device_ids`` for a CPU module: the rehearsed GPU tests pass them, so drop them."""
    if all(p.device.type == "cpu" for p in module.parameters()):
        args = tuple(None if i < 2 else a for i, a in enumerate(args))
        kwargs = {k: (None if k in ("device_ids", "output_device") else v) for k, v in kwargs.items()}
    return args, kwargs


class TorchOnCpu(TORCH_DDP):
    """torch's DDP, its GPU tests' ``device_ids`` dropped for CPU modules."""

    def __init__(self, module, *args, **kwargs):
        args, kwargs = _cpu_module_kwargs(module, args, kwargs)
        super().__init__(module, *args, **kwargs)


class DropIn(dpfast.DistributedDataParallel):
    """dpfast's DDP as a torch-DDP user swaps it in: ``inputs="per_rank"``, every other setting its default."""

    def __init__(self, module, *args, **kwargs):
        args, kwargs = _cpu_module_kwargs(module, args, kwargs)
        super().__init__(module, *args, inputs="per_rank", **kwargs)


CLASSES = {"torch": TorchOnCpu, "dpfast": DropIn}


def install(which: str) -> None:
    """Make ``which`` the ``DistributedDataParallel`` every name in the tests reaches."""
    cls = CLASSES[which]
    nn.parallel.DistributedDataParallel = cls  # type: ignore[misc]
    torch.nn.parallel.distributed.DistributedDataParallel = cls  # type: ignore[misc]
    dt.DistributedDataParallel = cls


def suite_class(which: str, tests: list[str]) -> type:
    """A ``unittest`` class of ``tests`` from torch's suite, run on forked ranks with ``which`` installed."""

    class Suite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            rehearse_cuda_on_cpu(int(os.environ["WORLD_SIZE"]))
            install(which)
            return super()._run(rank, test_name, file_name, pipe, **kwargs)

    for name in dir(dt.DistributedTest._DistTestBase):
        if name.startswith("test_") and name not in tests:
            # not collected (not callable); setUp reads test_ddp_has_finalized.__wrapped__
            wrapped = getattr(getattr(Suite, name), "__wrapped__", None)
            setattr(Suite, name, types.SimpleNamespace(__wrapped__=wrapped))
    Suite.__name__ = Suite.__qualname__ = f"TorchSuite_{which}"
    return Suite


def run(which: str, tests: list[str]) -> dict[str, str]:
    """Each test's outcome with ``which`` installed: ``"passed"``, ``"skipped: why"`` or ``"failed: why"``."""
    result = unittest.TestResult()
    unittest.TestLoader().loadTestsFromTestCase(suite_class(which, tests)).run(result)
    outcome = dict.fromkeys(tests, "passed")
    for case, text in result.failures + result.errors:
        errors = [line.strip() for line in text.splitlines() if "Error" in line or "Exception" in line]
        outcome[case.id().rsplit(".", 1)[-1]] = f"failed: {(errors or ['(no error line)'])[-1][:300]}"
    for case, reason in result.skipped:
        outcome[case.id().rsplit(".", 1)[-1]] = f"skipped: {reason[:100]}"
    return outcome


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="torch's DDP tests against torch's DDP and dpfast's drop-in")
    parser.add_argument("--all", action="store_true", help="every DDP test of torch's suite, not TORCH_PASSES")
    parser.add_argument("--tests", default="", help="comma-separated test names")
    parser.add_argument("--json", default="", help="write {class: {test: outcome}} here")
    args = parser.parse_args(argv)
    tests = [t for t in args.tests.split(",") if t] or (DDP_TESTS if args.all else list(TORCH_PASSES))
    outcomes = {which: run(which, tests) for which in CLASSES}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outcomes, f, indent=1)
    worse = []
    for t in tests:
        mine, theirs = outcomes["dpfast"][t], outcomes["torch"][t]
        print(f"{t:70s} torch: {theirs.split(':')[0]:8s} dpfast: {mine.split(':')[0]}")
        if theirs == "passed" and mine != "passed":
            worse.append(f"{t}: {mine}")
    passed = [sum(o[t] == "passed" for t in tests) for o in (outcomes["torch"], outcomes["dpfast"])]
    print(f"{len(tests)} tests: torch's DDP passes {passed[0]}, dpfast's drop-in {passed[1]}")
    lines = ["dpfast's drop-in fails where torch's passes:", *worse] if worse else ["none fails only with dpfast"]
    print("\n".join(lines))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
