"""Loads the compiled extension ``dpfast._C`` (which registers ``torch.ops.dpfast.*``) or explains why not.

Without it ``import dpfast`` still works: the ops fall back to :mod:`dpfast.reference` and a warning is issued
once. ``DPFAST_REQUIRE_EXTENSION=1`` (set in CI) turns a missing extension into an ImportError;
``DPFAST_NO_EXTENSION=1`` leaves a built one unloaded (CI runs the suite against the fallback so).

An extension is tied to the torch release it was compiled against. setup.py records that torch beside it
(``_build.json``); one built for another torch is not loaded at all (it may not even link, or crash later), and
the message names both versions and the command that rebuilds it.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from types import ModuleType
from typing import TypedDict

import torch

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dpfast package, where _C and its record lie
_CHECKOUT = os.path.dirname(_HERE)
_IN_CHECKOUT = os.path.isfile(os.path.join(_CHECKOUT, "setup.py"))


def _rebuild_command() -> str:
    if _IN_CHECKOUT:
        return f"`pip install --no-build-isolation -e {_CHECKOUT}` (or `make build` there)"
    # dpfast is not on a package index: it is rebuilt from a checkout or an sdist
    return "`pip install --no-build-isolation --no-deps --force-reinstall <dpfast checkout or sdist>`"


_BUILD_HINT = (
    f"build it with {_rebuild_command()}; "
    "CUDA kernels are compiled when DPFAST_CUDA=1, or DPFAST_CUDA=auto and nvcc and a GPU are found"
)


def _read_record() -> dict | None:
    """What setup.py wrote beside the extension: the torch it was built against, CUDA, arch list, the reason."""
    try:
        with open(os.path.join(_HERE, "_build.json")) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _release(version: str | None) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2]) if version else ()


def torch_mismatch(record: dict | None, torch_version: str, torch_cuda: str | None) -> str | None:
    """Why an extension with this build record cannot run on this torch, or None when it can: another torch
    release line (the C++ ABI differs), or CUDA kernels where this torch has no (or another major) CUDA."""
    built = (record or {}).get("torch")
    if not built:
        return None
    if _release(built) != _release(torch_version):
        return f"was built against torch {built}, but this is torch {torch_version}"
    built_cuda = record.get("torch_cuda")
    if record.get("cuda_kernels") and (torch_cuda or "").split(".")[0] != (built_cuda or "").split(".")[0]:
        has = f"built for CUDA {torch_cuda}" if torch_cuda else "a CPU-only build"
        return f"has CUDA kernels built against torch {built} (CUDA {built_cuda}); this torch {torch_version} is {has}"
    return None


def _fail(reason: str, exc: BaseException | None = None) -> None:
    """A missing or unusable extension: an error under DPFAST_REQUIRE_EXTENSION, else a warning and the fallback."""
    if os.environ.get("DPFAST_REQUIRE_EXTENSION", "0") not in ("", "0"):
        raise ImportError(
            f"dpfast: the compiled extension dpfast._C could not be loaded ({reason}) and DPFAST_REQUIRE_EXTENSION "
            f"is set; {_BUILD_HINT}"
        ) from exc
    warnings.warn(
        f"dpfast: compiled extension not loaded ({reason}); dpfast.ops falls back to the plain-PyTorch "
        f"dpfast.reference (correct, slower). To fix: {_BUILD_HINT}",
        RuntimeWarning,
        stacklevel=3,
    )


C: ModuleType | None = None
LOAD_ERROR: str | None = None
RECORD: dict | None = _read_record()

_mismatch = torch_mismatch(RECORD, torch.__version__, torch.version.cuda)
if os.environ.get("DPFAST_NO_EXTENSION", "0") not in ("", "0"):  # the fallback, on purpose (CI runs the suite so)
    LOAD_ERROR = "DPFAST_NO_EXTENSION is set: dpfast.reference serves the ops"
    _fail(LOAD_ERROR)
elif RECORD is not None and RECORD.get("extension") is False:  # DPFAST_PURE_PYTHON=1: nothing was compiled
    LOAD_ERROR = f"dpfast was installed without it: {RECORD.get('reason')}"
    _fail(LOAD_ERROR)
elif _mismatch is not None:
    LOAD_ERROR = f"dpfast._C {_mismatch}"
    _fail(LOAD_ERROR)
else:
    try:
        C = importlib.import_module("dpfast._C")  # registers torch.ops.dpfast.* as a side effect
    except ImportError as exc:  # also covers an ABI mismatch with the installed torch
        LOAD_ERROR = f"{type(exc).__name__}: {exc}"
        _fail(LOAD_ERROR, exc)

LOADED: bool = C is not None

if LOADED and (RECORD or {}).get("cuda_skipped_without_gpu") and torch.cuda.is_available():
    warnings.warn(
        "dpfast: dpfast._C was built without its CUDA kernels because no GPU was visible when it was built "
        "(DPFAST_CUDA=auto), so dpfast's ops cannot take CUDA tensors here; rebuild with DPFAST_CUDA=1: "
        f"{_rebuild_command()}",
        RuntimeWarning,
        stacklevel=2,
    )


class BuildInfo(TypedDict):
    """What :func:`build_info` returns: a plain ``dict`` at run time, with these keys and value types."""

    dpfast_version: str
    torch_version: str  # the running torch, "2.14.1+cu130"
    torch_cuda_version: str | None  # the CUDA that torch was built with; None: a CPU-only torch
    cuda_available: bool
    cuda_device_count: int
    extension_loaded: bool  # False: dpfast.ops runs on the dpfast.reference fallback
    extension_error: str | None  # why the extension did not load
    cuda_kernels_compiled: bool
    cuda_arch_list: str | None  # TORCH_CUDA_ARCH_LIST of the compiled CUDA kernels, "9.0"
    built_with_torch: str | None  # the torch the extension was compiled against
    build_reason: str | None  # setup.py's build decision (DPFAST_CUDA, the toolkit it found)
    debug_build: bool | None  # None: not recorded
    ops_backend: str  # "torch.ops.dpfast (C++)" or "dpfast.reference (plain PyTorch fallback)"


def build_info() -> BuildInfo:
    """Facts about this build: versions, whether the extension loaded, and which kernels were compiled.

    ``python -m dpfast info`` prints them (``--json``: this dict). The build facts come from the record setup.py
    wrote beside the extension (``_build.json``) and from the extension itself, as ``import dpfast`` loaded it.

    Returns:
        A dict with the keys of ``BuildInfo`` (a ``TypedDict``, so type checkers know each key's type):
        ``dpfast_version``, ``torch_version``, ``torch_cuda_version`` (``None`` for a CPU-only torch),
        ``cuda_available``, ``cuda_device_count``, ``extension_loaded`` and ``extension_error`` (why not, or
        ``None``), ``cuda_kernels_compiled``, ``cuda_arch_list``, ``built_with_torch``, ``build_reason``,
        ``debug_build``, and ``ops_backend`` (the C++ ops or the plain-PyTorch fallback). A fresh dict each call.

    Raises:
        Nothing: a missing or unusable extension is reported here (``extension_loaded``, ``extension_error``),
            not raised. (With ``DPFAST_REQUIRE_EXTENSION=1`` it is an ``ImportError`` at ``import dpfast``
            instead.)
    """
    from .. import __version__

    record = RECORD or {}
    return {
        "dpfast_version": __version__,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "extension_loaded": LOADED,
        "extension_error": LOAD_ERROR,
        "cuda_kernels_compiled": bool(getattr(C, "cuda_kernels_compiled", False)),
        "cuda_arch_list": getattr(C, "cuda_arch_list", None) or None,
        "built_with_torch": getattr(C, "built_with_torch", None) or record.get("torch"),
        "build_reason": record.get("reason"),
        "debug_build": record.get("debug"),
        "ops_backend": "torch.ops.dpfast (C++)" if LOADED else "dpfast.reference (plain PyTorch fallback)",
    }
