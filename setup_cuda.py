"""The CUDA half of dpfast's build decision, for setup.py: where the toolkit is, whether to compile the kernels,
and for which GPU architectures. Pure functions of the facts they are given or read (no setuptools here), so the
tests call them directly (tests/test_packaging.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess


def _run(*cmd: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        return ""


def find_cuda_home() -> tuple[str | None, str]:
    """CUDA_HOME or CUDA_PATH, else what nvcc's dry run names (torch would take a wrapper script's folder)."""
    var = next((v for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)), None)
    if var:
        return os.environ[var], f"{var}={os.environ[var]}"
    nvcc = shutil.which("nvcc")
    top = re.search(r"^#\$ TOP=(.+)$", _run(nvcc, "--dryrun", "-c", "-x", "cu", os.devnull), re.M) if nvcc else None
    if top:
        return os.path.realpath(top[1].strip()), f"nvcc on PATH ({nvcc})"
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda", "/usr/local/cuda"
    return None, "no CUDA_HOME, no nvcc on PATH, nothing in /usr/local/cuda; set CUDA_HOME to the toolkit"


def nvcc_version(root: str) -> str | None:
    m = re.search(r"release (\d+\.\d+)", _run(os.path.join(root, "bin", "nvcc"), "--version"))
    return m.group(1) if m else None


def decide_cuda(mode, torch_version, torch_cuda, root, how, toolkit_cuda, gpu_visible) -> tuple[bool, str]:
    """Whether to compile the CUDA kernels, and why. Pure: the caller gathers the facts."""
    if mode not in ("auto", "1", "0"):
        raise SystemExit(f"[dpfast build] DPFAST_CUDA={mode!r} is not one of auto, 1, 0")
    if mode == "0":
        return False, "DPFAST_CUDA=0"
    want, have = (v.split(".")[0] if v else "?" for v in (torch_cuda, toolkit_cuda))
    missing = [] if torch_cuda else [f"torch {torch_version} is a CPU-only build (install a CUDA build of torch)"]
    if root is None or not os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        missing.append(f"no CUDA toolkit found ({how})" if root is None else f"{root} ({how}) is no CUDA toolkit")
    elif torch_cuda and want != have:  # torch refuses a toolkit of another major version
        missing.append(
            f"the CUDA toolkit {root} ({how}) is CUDA {toolkit_cuda} but torch {torch_version} was built "
            f"for CUDA {torch_cuda}; their major versions must match (set CUDA_HOME to a CUDA {want}.x "
            f"toolkit, or install a torch built for CUDA {have})"
        )
    if missing and mode == "1":
        raise SystemExit("[dpfast build] DPFAST_CUDA=1 but CUDA kernels cannot be built: " + "; ".join(missing))
    if not missing and mode == "auto" and not gpu_visible:
        missing.append("no GPU is visible, so they could not run here (DPFAST_CUDA=1 compiles them anyway)")
    if missing:
        return False, "DPFAST_CUDA=auto and " + "; ".join(missing)
    return True, f"DPFAST_CUDA={mode}; toolkit {root} (CUDA {toolkit_cuda}) from {how}; torch CUDA {torch_cuda}"


def default_arch_list(torch_archs: list[str], nvcc_archs: list[str]) -> str | None:
    """The plain architectures torch was built for ("sm_90", not "sm_90a") that nvcc supports, plus PTX of the
    newest for newer GPUs: the kernels then run wherever torch's do. None when they share none."""
    supported = {n[8:] for n in nvcc_archs if n.startswith("compute_") and n[8:].isdigit()}
    both = sorted({int(n[3:]) for n in torch_archs if n[3:].isdigit() and (n[3:] in supported or not supported)})
    return ";".join(f"{a // 10}.{a % 10}" for a in both) + "+PTX" if both else None


def choose_arch_list(torch, root: str) -> tuple[str, str]:
    """TORCH_CUDA_ARCH_LIST and why; also where torch's own choice fails (no GPU visible: an IndexError)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        return os.environ["TORCH_CUDA_ARCH_LIST"].strip(), "TORCH_CUDA_ARCH_LIST"
    if torch.cuda.device_count():
        caps = sorted(set(map(torch.cuda.get_device_capability, range(torch.cuda.device_count()))))
        return ";".join(f"{a}.{b}" for a, b in caps) + "+PTX", "TORCH_CUDA_ARCH_LIST unset: the visible GPUs"
    archs = torch.cuda.get_arch_list() or torch._C._cuda_getArchFlags().split()
    arch_list = default_arch_list(archs, _run(os.path.join(root, "bin", "nvcc"), "--list-gpu-arch").split())
    if arch_list is None:
        raise SystemExit(
            f"[dpfast build] no GPU visible and nvcc supports none of torch's architectures {archs}: "
            "set TORCH_CUDA_ARCH_LIST (e.g. 9.0)"
        )
    return arch_list, "TORCH_CUDA_ARCH_LIST unset, no GPU visible: torch's architectures that this nvcc supports"
