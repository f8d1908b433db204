"""Helpers shared by the examples: device choice, the float64 equality check, and printing.

Not part of dpfast's API; kept small so each example reads top to bottom.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch
from torch import Tensor

import dpfast


def add_example_args(parser: argparse.ArgumentParser, batch: int, steps: int) -> None:
    """The options every example takes: devices, seed, quiet, batch size and training steps."""
    parser.add_argument(
        "--devices",
        default="auto",
        help="'auto' (every GPU when there are two or more; a 4-replica rehearsal on cuda:0 with one GPU; "
        "a 4-replica CPU rehearsal without a GPU), 'cpu:N' (an N-replica CPU rehearsal), 'cuda' (every GPU), "
        "or a comma list of device ids such as '0,1' or '0,0,0,0' (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line")
    parser.add_argument("--batch", type=int, default=batch, help="batch size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps, help="training steps (default: %(default)s)")


DeviceIds = Sequence[Union[int, str]]  # what pick_devices gives DataParallel: CUDA indices, or "cpu" repeated


def pick_devices(spec: str = "auto") -> tuple[DeviceIds, str]:
    """``device_ids`` for ``dpfast.DataParallel`` and a sentence saying why."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        if n_gpu >= 2:
            return list(range(n_gpu)), f"all {n_gpu} GPUs"
        if n_gpu == 1:
            return [0] * 4, "one GPU: a rehearsal with 4 replicas on cuda:0"
        return ["cpu"] * 4, "no GPU: a CPU rehearsal with 4 replicas (device_ids=['cpu'] * 4)"
    if spec == "cuda":
        if n_gpu == 0:
            raise SystemExit("--devices cuda: no CUDA device is visible")
        return list(range(n_gpu)), f"all {n_gpu} GPUs"
    if spec.startswith("cpu"):
        n = int(spec.split(":", 1)[1]) if ":" in spec else 4
        return ["cpu"] * n, f"a CPU rehearsal with {n} replicas (device_ids=['cpu'] * {n})"
    ids = [int(s) for s in spec.split(",") if s.strip()]
    return ids, f"device_ids={ids}"


def home_device(device_ids: DeviceIds) -> torch.device:
    d = device_ids[0]
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


class Report:
    """Collects pass/fail lines of the equality check and prints them as they come."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.failures: list[str] = []
        self.passed = 0

    def say(self, *lines: Any) -> None:
        if not self.quiet:
            for line in lines:
                print(line)

    def compare(self, what: str, actual: Any, expected: Any, rtol: float = 1e-9, atol: float = 1e-11) -> bool:
        """``actual`` and ``expected`` (tensors, or tuples/lists of them) must be equal to float64 rounding."""
        a, e = list(_tensors(actual)), list(_tensors(expected))
        problem: str | None = None
        worst = 0.0
        if len(a) != len(e):
            problem = f"{len(a)} tensors vs {len(e)}"
        for x, y in zip(a, e):
            if problem:
                break
            if x is None or y is None:
                if (x is None) != (y is None):
                    problem = "one side has no gradient"
                continue
            if x.shape != y.shape:
                problem = f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
                break
            x, y = x.detach().cpu(), y.detach().cpu()
            if x.numel():
                worst = max(worst, float((x - y).abs().max()))
            # torch.testing.assert_close would do, but its first call imports torch.distributed.tensor (seconds)
            if x.dtype != y.dtype:
                problem = f"dtype {x.dtype} vs {y.dtype}"
            elif not torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all():
                problem = f"max |diff| = {worst:.3g} (rtol={rtol}, atol={atol})"
        if problem:
            self.failures.append(f"{what}: {problem}")
            self.say(f"  MISMATCH {what}: {problem}")
            return False
        self.passed += 1
        self.say(f"  ok  {what:<44} max |diff| = {worst:.1e}")
        return True

    @property
    def ok(self) -> bool:
        return not self.failures


def _tensors(obj: Any) -> Iterable[Tensor | None]:
    if obj is None or isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _tensors(obj[k])
    else:
        raise TypeError(f"cannot compare a {type(obj).__name__}")


def show_scatter_error(
    report: Report, dp: dpfast.DataParallel, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """Call ``dp`` expecting :class:`dpfast.ScatterError`; print it and return its message (None if not raised)."""
    if len(dp.device_ids) < 2:  # one device: like torch, nothing is split, so nothing can be split wrongly
        report.say("(one device: nothing is split, so there is no error to show; try --devices cpu:4)")
        return "one device"
    try:
        dp(*args, **kwargs)
    except dpfast.ScatterError as exc:
        report.say("dpfast raises, before copying anything:", "", f"dpfast.ScatterError: {exc}")
        return str(exc)
    report.failures.append("no ScatterError without the spec")
    report.say("  MISMATCH: expected a ScatterError without the spec, got none")
    return None


def title(report: Report, text: str) -> None:
    report.say("", text, "-" * len(text))


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    """Plain SGD by hand: torch.optim's first use imports torch._dynamo, seconds on a small CPU box."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)
                p.grad = None
