"""Builds dpfast._C against the torch that dpfast will run with.

Install from a checkout or an sdist with ``pip install --no-build-isolation .`` (``-e .`` for development) after
``pip install torch 'setuptools>=77' wheel ninja``: a torch extension is tied to the exact torch release it was
compiled against, and pip's build isolation would compile against a different torch downloaded for the build.

CPU kernels always; CUDA kernels by DPFAST_CUDA (auto|1|0, default auto). auto: when torch is a CUDA build and a
CUDA toolkit (nvcc) of torch's CUDA major version is found, else CPU only, with the reason in the build log and in
``dpfast.build_info()``. 1: required; anything missing is a hard error that names it. 0: CPU only.
CUDA_HOME picks the toolkit, TORCH_CUDA_ARCH_LIST the GPU architectures (default: the visible GPUs, else the
architectures torch itself was built for), MAX_JOBS the parallel compile jobs. DPFAST_DEBUG=1 keeps debug info
(release builds carry none).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

MIN_SETUPTOOLS = 77  # pyproject.toml's SPDX `license` and `license-files` need it
SUPPORTED_TORCH = "torch>=2.4"
HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = "_build.json"  # the build decision, written beside the extension for dpfast.build_info()


def log(msg: str) -> None:
    print(f"[dpfast build] {msg}", file=sys.stderr, flush=True)


def check_setuptools(version: str) -> None:
    """Older setuptools reject pyproject.toml with a message that does not say what to do: say it first."""
    m = re.match(r"(\d+)", version)
    if m and int(m.group(1)) < MIN_SETUPTOOLS:
        raise SystemExit(
            f"[dpfast build] setuptools {version} is too old: dpfast needs setuptools>={MIN_SETUPTOOLS}. With "
            "--no-build-isolation pip builds with this environment's own build tools, so install them first: "
            f"pip install 'setuptools>={MIN_SETUPTOOLS}' wheel ninja"
        )


import setuptools  # noqa: E402 - the version check above must come before setuptools reads pyproject.toml

check_setuptools(setuptools.__version__)

from setuptools import Extension, find_packages, setup  # noqa: E402
from setuptools.command.build_ext import build_ext as plain_build_ext  # noqa: E402

# ---- which torch ------------------------------------------------------------------------------------------------


def _hidden_site_dirs() -> list[str]:
    """This interpreter's site-packages that are not on sys.path: what pip's build isolation hides."""
    on_path = {os.path.realpath(p) for p in sys.path if p}
    dirs = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    return [d for d in dirs if os.path.isdir(d) and os.path.realpath(d) not in on_path]


def find_torch():
    """The torch to build against: the importable one, else the one installed where dpfast is being installed.

    Under pip's build isolation (plain ``pip install .``) torch is not importable, but the environment pip installs
    into is still this interpreter's, and its torch is the one dpfast will run with: build against that.
    """
    try:
        import torch

        return torch
    except ImportError:
        pass
    for site_dir in _hidden_site_dirs():
        if os.path.isfile(os.path.join(site_dir, "torch", "__init__.py")):
            sys.path.append(site_dir)  # last: the isolated build tools still win
            import torch

            log(
                f"pip's build isolation hides the installed torch; building against torch {torch.__version__} "
                f"from {site_dir}, the torch dpfast will run with (`pip install --no-build-isolation .` skips "
                "the isolated environment)"
            )
            return torch
    return None


NO_TORCH = (
    "[dpfast build] torch is not installed: dpfast compiles against the torch it will run with. Install torch "
    f"first (pip install torch 'setuptools>={MIN_SETUPTOOLS}' wheel ninja), then pip install --no-build-isolation ."
)


def torch_requirement(torch_version: str | None) -> str:
    """What the package requires of torch: the major.minor it was built against (an extension's C++ ABI is tied to
    that release line), or any supported torch when nothing is compiled (an sdist)."""
    if torch_version is None:
        return SUPPORTED_TORCH
    major, minor = re.match(r"(\d+)\.(\d+)", torch_version).groups()
    return f"torch=={major}.{minor}.*"


# ---- the CUDA toolkit -------------------------------------------------------------------------------------------


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


def _nvcc(root: str, *args: str) -> str:
    try:
        out = subprocess.run([os.path.join(root, "bin", "nvcc"), *args], capture_output=True, text=True, timeout=60)
        return out.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def nvcc_version(root: str) -> str | None:
    """The toolkit's CUDA version, "13.0", from `nvcc --version`."""
    m = re.search(r"release (\d+\.\d+)", _nvcc(root, "--version"))
    return m.group(1) if m else None


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
DEBUG = os.environ.get("DPFAST_DEBUG", "0") not in ("", "0")


def _major(version: str | None) -> str | None:
    return version.split(".")[0] if version else None


def decide_cuda(
    mode: str, torch_version: str, torch_cuda: str | None, root: str | None, how: str, toolkit_cuda: str | None
) -> tuple[bool, str]:
    """Whether to compile the CUDA kernels, and why. Pure: the caller gathers the facts."""
    if mode not in ("auto", "1", "0"):
        raise SystemExit(f"[dpfast build] DPFAST_CUDA={mode!r} is not one of auto, 1, 0")
    if mode == "0":
        return False, "DPFAST_CUDA=0"
    missing = []
    if torch_cuda is None:
        missing.append(f"torch {torch_version} is a CPU-only build (install a CUDA build of torch)")
    if root is None:
        missing.append(f"no CUDA toolkit found ({how}; set CUDA_HOME to the toolkit root)")
    elif torch_cuda is not None and _major(toolkit_cuda) != _major(torch_cuda):
        # torch refuses a toolkit of another CUDA major version (its "CUDA version mismatches" error)
        missing.append(
            f"the CUDA toolkit {root} (from {how}) is CUDA {toolkit_cuda or 'of unknown version'} but torch "
            f"{torch_version} was built for CUDA {torch_cuda}; their major versions must match (set CUDA_HOME "
            f"to a CUDA {_major(torch_cuda)}.x toolkit, or install a torch built for CUDA {_major(toolkit_cuda)})"
        )
    if missing:
        if mode == "1":
            raise SystemExit("[dpfast build] DPFAST_CUDA=1 but CUDA kernels cannot be built: " + "; ".join(missing))
        return False, "DPFAST_CUDA=auto and " + "; ".join(missing)
    return True, f"DPFAST_CUDA={mode}; toolkit {root} (CUDA {toolkit_cuda}) from {how}; torch CUDA {torch_cuda}"


# ---- GPU architectures ------------------------------------------------------------------------------------------


def _arch_numbers(names: list[str], prefix: str) -> list[int]:
    """[75, 90] from ["sm_75", "sm_90", "sm_90a"]: plain architectures only (no arch-specific "a" variants)."""
    return sorted({int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()})


def _as_list(numbers: list[int]) -> str:
    """Like "7.5;9.0+PTX": PTX of the newest lets GPUs newer than all of them JIT-compile the kernels."""
    return ";".join(f"{n // 10}.{n % 10}" for n in numbers) + "+PTX"


def default_arch_list(torch_archs: list[str], nvcc_archs: list[str]) -> str | None:
    """The architectures torch was built for ("sm_90") that nvcc can compile for ("compute_90"): dpfast's kernels
    then run wherever torch's do. None when they share none."""
    ours = _arch_numbers(torch_archs, "sm_")
    supported = set(_arch_numbers(nvcc_archs, "compute_"))
    both = [a for a in ours if a in supported] if supported else ours
    return _as_list(both) if both else None


def choose_arch_list(torch, root: str) -> tuple[str, str]:
    """TORCH_CUDA_ARCH_LIST for this build and why. Set explicitly even when torch could pick: torch's own pick
    fails without a visible GPU (IndexError in _get_cuda_arch_flags)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return env, "TORCH_CUDA_ARCH_LIST"
    n_gpus = torch.cuda.device_count()
    if n_gpus:
        caps = sorted({major * 10 + minor for major, minor in map(torch.cuda.get_device_capability, range(n_gpus))})
        return _as_list(caps), f"TORCH_CUDA_ARCH_LIST unset: the {n_gpus} visible GPU(s)"
    torch_archs = torch.cuda.get_arch_list() or torch._C._cuda_getArchFlags().split()
    arch_list = default_arch_list(torch_archs, _nvcc(root, "--list-gpu-arch").split())
    if arch_list is None:
        raise SystemExit(
            f"[dpfast build] TORCH_CUDA_ARCH_LIST is unset, no GPU is visible, and torch's architectures "
            f"{torch_archs} are not ones the nvcc in {root} supports: set TORCH_CUDA_ARCH_LIST (e.g. 9.0)"
        )
    return arch_list, (
        "TORCH_CUDA_ARCH_LIST unset and no GPU visible: the architectures torch was built for that this nvcc "
        "supports (set TORCH_CUDA_ARCH_LIST, e.g. 9.0, to build for fewer, faster)"
    )


# ---- the extension ----------------------------------------------------------------------------------------------


def _sources(*patterns: str) -> list[str]:
    return sorted(os.path.relpath(p, HERE) for pattern in patterns for p in glob.glob(os.path.join(HERE, pattern)))


CPU_SOURCES = _sources("csrc/*.cpp", "csrc/cpu/*.cpp")
CUDA_SOURCES = _sources("csrc/cuda/*.cpp", "csrc/cuda/*.cu")


def configure_extension(ext: Extension, torch) -> dict:
    """Turn the placeholder ``dpfast._C`` into the real torch extension; returns the build record.

    Done when build_ext runs, not when setup.py is read: metadata and sdist steps need neither the decision
    (and its log) nor a toolkit.
    """
    from torch.utils import cpp_extension

    if SANITIZE:
        with_cuda, reason = False, "DPFAST_SANITIZE=1 (CPU kernels under AddressSanitizer and UBSan)"
        root = None
    else:
        mode = os.environ.get("DPFAST_CUDA", "auto").strip().lower()
        root, how = find_cuda_home() if mode != "0" else (None, "")
        toolkit_cuda = nvcc_version(root) if root else None
        with_cuda, reason = decide_cuda(mode, torch.__version__, torch.version.cuda, root, how, toolkit_cuda)
    log(f"CUDA kernels: {'ON' if with_cuda else 'OFF'} ({reason})")
    torch_version = torch.__version__.split("+")[0]
    # Only facts that change the object code go into compile flags: a changed flag recompiles every file.
    define = [("DPFAST_BUILT_WITH_TORCH", f'"{torch_version}"')]
    if SANITIZE:
        cxx, link = ["-fvisibility=hidden", *SANITIZE_FLAGS], ["-fsanitize=address,undefined"]
    else:
        # Python's own flags carry -g; -g0 after them drops the debug info (most of the file's size)
        cxx, link = ["-O3", "-fvisibility=hidden", "-g" if DEBUG else "-g0"], []
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        # at::parallel_for is a header template: without -fopenmp it silently runs on one thread in our code
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    sources, extra, arch_list = list(CPU_SOURCES), {"cxx": cxx}, None
    if with_cuda:
        os.environ["CUDA_HOME"] = root
        cpp_extension.CUDA_HOME = root  # read when torch.utils.cpp_extension was imported, before we chose
        arch_list, why = choose_arch_list(torch, root)
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        log(f"TORCH_CUDA_ARCH_LIST={arch_list} ({why})")
        sources += CUDA_SOURCES
        define += [("DPFAST_WITH_CUDA", None), ("DPFAST_CUDA_ARCH_LIST", f'"{arch_list}"')]
        extra["nvcc"] = ["-O3", "--expt-relaxed-constexpr"] + (["-lineinfo"] if DEBUG else [])
    log(f"MAX_JOBS={os.environ.get('MAX_JOBS', '(unset: ninja uses every core)')}")
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    real = kind(
        ext.name,
        sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        define_macros=define,
        extra_compile_args=extra,
        extra_link_args=link,
    )
    for key, value in vars(real).items():  # keep what build_ext's finalize_options set on the placeholder
        if not key.startswith("_"):
            setattr(ext, key, value)
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_kernels": with_cuda,
        "cuda_arch_list": arch_list,
        "reason": reason,
        "debug": DEBUG or SANITIZE,
    }


def build_ext_class(torch):
    from torch.utils.cpp_extension import BuildExtension

    class TorchBuild(BuildExtension):
        """Compiles dpfast._C with torch's flags, keeps objects in ./build so rebuilds compile only what changed
        (ninja), and writes the build record beside the extension."""

        def build_extensions(self) -> None:
            self.records = {ext.name: configure_extension(ext, torch) for ext in self.extensions}
            # One objects folder per torch installation and configuration: switching venvs, CUDA or debug and
            # back recompiles nothing (torch's include path is in every compile command).
            record = self.records["dpfast._C"]
            mm = ".".join(torch.__version__.split(".")[:2])
            kind = ("cuda" if record["cuda_kernels"] else "cpu") + ("-debug" if DEBUG else "")
            where = hashlib.sha1(os.path.dirname(os.path.realpath(torch.__file__)).encode()).hexdigest()[:8]
            tag = (
                ("sanitize", "temp") if SANITIZE else (f"temp.{sys.implementation.cache_tag}-torch{mm}-{kind}-{where}",)
            )
            self.build_temp = os.path.join(HERE, "build", *tag)
            super().build_extensions()

        def build_extension(self, ext) -> None:
            super().build_extension(ext)
            self.record_path = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), RECORD)
            with open(self.record_path, "w") as f:
                json.dump(self.records[ext.name], f, indent=1, sort_keys=True)

        def copy_extensions_to_source(self) -> None:  # --inplace and editable installs
            super().copy_extensions_to_source()
            package_dir = self.get_finalized_command("build_py").get_package_dir("dpfast")
            self.copy_file(self.record_path, os.path.join(package_dir, RECORD), level=self.verbose)

    return TorchBuild.with_options(use_ninja=True)


class NoTorchBuild(plain_build_ext):
    def run(self) -> None:
        raise SystemExit(NO_TORCH)


# ---- the package description ------------------------------------------------------------------------------------

_RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?![a-z][a-z0-9+.-]*:)([^)\s]+)\)")


def readme_for_index(text: str) -> str:
    """README.md without links into the repository, which break on a package index: the link text stays, and a
    file's path is named where the text does not already say it."""

    def plain(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if target.startswith("#") or target in label:
            return label
        return f"{label} (`{target}` in the source distribution)"

    return _RELATIVE_LINK.sub(plain, text)


# examples/ and benchmarks/ stay where they are in the tree and ship as dpfast.examples and dpfast.benchmarks, so
# `python -m dpfast demo|bench` works from an installed wheel too
SHIPPED_FOLDERS = {"dpfast.examples": "examples", "dpfast.benchmarks": "benchmarks"}


def packages() -> list[str]:
    return sorted(find_packages(HERE, include=["dpfast", "dpfast.*"]) + list(SHIPPED_FOLDERS))


def main() -> None:
    sdist_only = "sdist" in sys.argv[1:]  # an sdist compiles nothing: no torch, and any supported torch
    torch = None if sdist_only else find_torch()
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = readme_for_index(f.read())
    setup(
        long_description=readme,
        long_description_content_type="text/markdown",
        packages=packages(),
        package_dir=SHIPPED_FOLDERS,
        install_requires=[torch_requirement(torch.__version__ if torch else None)],
        # a placeholder with every source, completed by build_ext (configure_extension)
        ext_modules=[Extension("dpfast._C", CPU_SOURCES + CUDA_SOURCES)],
        cmdclass={"build_ext": build_ext_class(torch) if torch else NoTorchBuild},
    )


if __name__ == "__main__":
    main()
