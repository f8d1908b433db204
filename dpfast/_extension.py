"""Loads the compiled extension ``dpfast._C`` (which registers ``torch.ops.dpfast.*``) or explains why not.

Without it ``import dpfast`` still works: the ops fall back to :mod:`dpfast.reference` and a warning is issued
once. ``DPFAST_REQUIRE_EXTENSION=1`` (set in CI) turns a missing extension into an ImportError.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` in the repository (or `make build`); "
    "CUDA kernels are compiled when DPFAST_CUDA=1, or DPFAST_CUDA=auto and nvcc is found"
)

C: ModuleType | None = None
LOAD_ERROR: str | None = None

try:
    C = importlib.import_module("dpfast._C")  # registers torch.ops.dpfast.* as a side effect
except ImportError as exc:  # also covers an ABI mismatch with the installed torch
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"
    if os.environ.get("DPFAST_REQUIRE_EXTENSION", "0") not in ("", "0"):
        raise ImportError(
            f"dpfast: the compiled extension dpfast._C could not be loaded ({LOAD_ERROR}) and "
            f"DPFAST_REQUIRE_EXTENSION is set; {_BUILD_HINT}"
        ) from exc
    warnings.warn(
        f"dpfast: compiled extension not loaded ({LOAD_ERROR}); dpfast.ops falls back to the plain-PyTorch "
        f"dpfast.reference (correct, slower). To fix: {_BUILD_HINT}",
        RuntimeWarning,
        stacklevel=2,
    )

LOADED: bool = C is not None


def build_info() -> dict:
    """Facts about this build: versions, whether the extension loaded, and which kernels were compiled."""
    info: dict = {
        "dpfast_version": _version(),
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "extension_loaded": LOADED,
        "extension_error": LOAD_ERROR,
        "cuda_kernels_compiled": bool(getattr(C, "cuda_kernels_compiled", False)),
        "cuda_arch_list": getattr(C, "cuda_arch_list", None) or None,
        "built_with_torch": getattr(C, "built_with_torch", None),
        "build_reason": _build_reason() if LOADED else None,
        "ops_backend": "torch.ops.dpfast (C++)" if LOADED else "dpfast.reference (plain PyTorch fallback)",
    }
    return info


def _build_reason() -> str | None:
    """Why CUDA kernels were (not) built, as setup.py wrote it beside the extension."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_reason.txt")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("dpfast")
    except Exception:  # running from a source tree that was never installed
        return "unknown"
