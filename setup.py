"""Builds dpfast._C: CPU kernels always, CUDA kernels when DPFAST_CUDA says so (auto|1|0, default auto).

auto: CUDA kernels when torch is a CUDA build and a CUDA toolkit (nvcc) is found. 1: required; a missing
toolkit is a hard error that says what is missing. 0: CPU only. Respects CUDA_HOME, TORCH_CUDA_ARCH_LIST
and MAX_JOBS (parallel compile jobs, read by torch's ninja build).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup


def log(msg: str) -> None:
    print(f"[dpfast build] {msg}", file=sys.stderr, flush=True)


def _is_toolkit(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
        os.path.join(root, "include", "cuda_runtime.h")
    )


def find_cuda_home() -> tuple[str | None, str]:
    """The CUDA toolkit root and how it was found. CUDA_HOME/CUDA_PATH first, then the toolkit behind `nvcc`
    (which may be a wrapper script: ask nvcc itself via --dryrun), then /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            if _is_toolkit(root):
                return root, f"{var}={root}"
            log(f"warning: {var}={root} has no bin/nvcc and include/cuda_runtime.h; looking elsewhere")
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        root = os.path.dirname(os.path.dirname(real))
        if _is_toolkit(root):
            return root, f"nvcc on PATH ({nvcc} -> {real})"
        try:  # a wrapper script: nvcc's dry run prints '#$ TOP=<toolkit>/bin/..'
            out = subprocess.run(
                [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=30,
            )
            m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
            if m:
                root = os.path.realpath(m.group(1).strip())  # TOP is <toolkit>/bin/..
                if _is_toolkit(root):
                    return root, f"nvcc on PATH ({nvcc}, a wrapper; its dry run names the toolkit {root})"
        except (OSError, subprocess.SubprocessError):
            pass
    if _is_toolkit("/usr/local/cuda"):
        return "/usr/local/cuda", "default location /usr/local/cuda"
    return None, "no CUDA_HOME, no nvcc on PATH, nothing in /usr/local/cuda"


# DPFAST_SANITIZE=1 (`make sanitize`): the CPU extension under AddressSanitizer and UBSan, in its own build folder.
# -fno-wrapv undoes the -fwrapv that Python's own flags add, which would hide signed overflow from UBSan.
SANITIZE = os.environ.get("DPFAST_SANITIZE", "0") not in ("", "0")
SANITIZE_FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-fno-wrapv",
    "-g",
    "-O1",
]


def decide_cuda() -> tuple[bool, str]:
    if SANITIZE:
        return False, "DPFAST_SANITIZE=1 (CPU kernels under AddressSanitizer and UBSan)"
    mode = os.environ.get("DPFAST_CUDA", "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        raise SystemExit(f"[dpfast build] DPFAST_CUDA={mode!r} is not one of auto, 1, 0")
    if mode == "0":
        return False, "DPFAST_CUDA=0"
    import torch

    root, how = find_cuda_home()
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)")
    if root is None:
        missing.append(f"no CUDA toolkit found ({how}; set CUDA_HOME to the toolkit root)")
    if missing:
        if mode == "1":
            raise SystemExit("[dpfast build] DPFAST_CUDA=1 but CUDA kernels cannot be built: " + "; ".join(missing))
        return False, "DPFAST_CUDA=auto and " + "; ".join(missing)
    os.environ["CUDA_HOME"] = root  # torch.utils.cpp_extension reads it at import time
    return True, f"DPFAST_CUDA={mode}; toolkit {root} from {how}; torch CUDA {torch.version.cuda}"


def extension():
    with_cuda, reason = decide_cuda()
    import torch
    from torch.utils import cpp_extension

    log(f"CUDA kernels: {'ON' if with_cuda else 'OFF'} ({reason})")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(
        glob.glob(os.path.join(here, "csrc", "*.cpp")) + glob.glob(os.path.join(here, "csrc", "cpu", "*.cpp"))
    )
    arch_list = ""
    torch_version = torch.__version__.split("+")[0]
    # Only facts that change the object code go into compile flags: a changed flag recompiles every file. The
    # decision's wording goes to a file next to the extension instead.
    define = [("DPFAST_BUILT_WITH_TORCH", f'"{torch_version}"')]
    if not SANITIZE:  # the sanitized build lives beside the normal one and must not rewrite its record
        with open(os.path.join(here, "dpfast", "_build_reason.txt"), "w") as f:
            f.write(reason + "\n")
    cxx = ["-O3", "-fvisibility=hidden"] if not SANITIZE else ["-fvisibility=hidden"] + SANITIZE_FLAGS
    link = [] if not SANITIZE else ["-fsanitize=address,undefined"]
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        # at::parallel_for is a header template: without -fopenmp it silently runs on one thread in our code
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if with_cuda:
        sources += sorted(
            glob.glob(os.path.join(here, "csrc", "cuda", "*.cpp"))
            + glob.glob(os.path.join(here, "csrc", "cuda", "*.cu"))
        )
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        log(f"TORCH_CUDA_ARCH_LIST={arch_list or '(unset: torch picks the visible GPUs or its default list)'}")
        define += [("DPFAST_WITH_CUDA", None), ("DPFAST_CUDA_ARCH_LIST", f'"{arch_list or "torch default"}"')]
    log(f"MAX_JOBS={os.environ.get('MAX_JOBS', '(unset: ninja uses every core)')}")
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    extra = {"cxx": cxx}
    if with_cuda:
        extra["nvcc"] = ["-O3", "--expt-relaxed-constexpr"]
    return kind(
        "dpfast._C",
        [os.path.relpath(s, here) for s in sources],
        include_dirs=[os.path.join(here, "csrc")],
        define_macros=define,
        extra_compile_args=extra,
        extra_link_args=link,
    )


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class PersistentBuild(BuildExtension):
        """Keeps objects in ./build so `pip install -e .` rebuilds only what changed (ninja), not everything."""

        def finalize_options(self) -> None:
            super().finalize_options()
            sub = ("sanitize", "temp") if SANITIZE else ("temp",)
            self.build_temp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", *sub)

    return PersistentBuild.with_options(use_ninja=True)


if __name__ == "__main__":
    setup(ext_modules=[extension()], cmdclass={"build_ext": build_ext_class()})
