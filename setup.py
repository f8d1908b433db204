"""Builds dpfast._C against the torch dpfast will run with: `pip install --no-build-isolation .`. The switches
(DPFAST_CUDA, DPFAST_PURE_PYTHON, DPFAST_TEST_HOOKS, ...) and the reasons: docs/installing.md. Where the CUDA
toolkit is and whether to compile the CUDA kernels: setup_cuda.py."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shlex
import shutil
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = "_build.json"  # what was built and why, beside the extension, for dpfast.build_info()
PURE, HOOKS, DEBUG, SANITIZE = [
    os.environ.get(f"DPFAST_{k}", "0") not in ("", "0") for k in ("PURE_PYTHON", "TEST_HOOKS", "DEBUG", "SANITIZE")
]
# -fno-wrapv undoes the -fwrapv of Python's own flags, which would hide signed overflow from UBSan
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-fno-wrapv"]
# whether this run of setup.py compiles (pip runs it for metadata first): only then does it say what it decides
COMPILING = not PURE and bool(
    {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"} & {*sys.argv}
)


def log(msg: str) -> None:
    if COMPILING:
        print(f"[dpfast build] {msg}", file=sys.stderr, flush=True)


def setuptools_problem(version: str) -> str | None:
    """pip checks no build requirement under --no-build-isolation; an older setuptools fails on the license field."""
    too_old = int(version.split(".")[0]) < 77
    return f"setuptools {version} is too old: pip install 'setuptools>=77' wheel ninja" if too_old else None


def compiler_problem() -> str | None:
    """No C++ compiler, in one line, before it fails in the middle of pip's output (torch runs $CXX, else c++)."""
    cxx = os.environ.get("CXX", "").strip()
    if shutil.which(shlex.split(cxx)[0] if cxx else "c++"):
        return None
    return (
        f"no C++ compiler ({f'CXX={cxx!r} is not a program' if cxx else 'no `c++` on PATH'}): install one (Debian/"
        "Ubuntu: apt install g++; Fedora: dnf install gcc-c++; conda: conda install gxx) or set CXX to one; or install "
        "dpfast without its compiled ops (they then run on dpfast.reference): DPFAST_PURE_PYTHON=1 pip install ..."
    )


def import_torch():
    """The torch dpfast will run with, also where pip's build isolation hides this interpreter's site-packages."""
    sites = [p for p in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")) if p not in sys.path]
    try:
        import torch
    except ImportError:
        if not any(os.path.isfile(os.path.join(s, "torch", "__init__.py")) for s in sites):
            return None
        sys.path += sites  # last: the isolated build tools still win
        import torch

        log(f"pip's build isolation hides the installed torch {torch.__version__}: building against it anyway")
    return torch


def torch_requirement(torch_version: str | None) -> str:
    """The release line the extension was compiled against (its C++ ABI), or any supported torch (nothing built)."""
    return "torch>=2.4" if torch_version is None else "torch=={}.{}.*".format(*torch_version.split(".")[:2])


def beside(name: str):
    """A module next to setup.py, loaded by its path: pip may run setup.py with another sys.path."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cuda = beside("setup_cuda")  # find_cuda_home, decide_cuda, choose_arch_list, ...


def sources(*patterns: str) -> list[str]:
    return sorted(os.path.relpath(p, HERE) for pattern in patterns for p in glob.glob(os.path.join(HERE, pattern)))


def extensions(torch) -> tuple[list, dict]:
    """dpfast._C (and dpfast._C_hooks with DPFAST_TEST_HOOKS=1) for this machine, and the build record."""
    from torch.utils import cpp_extension as ce

    mode = "0" if SANITIZE else os.environ.get("DPFAST_CUDA", "auto").strip().lower()
    root, how = cuda.find_cuda_home() if mode != "0" else (None, "")
    facts = (mode, torch.__version__, torch.version.cuda, root, how, cuda.nvcc_version(root) if root else None)
    with_cuda, reason = cuda.decide_cuda(*facts, torch.cuda.is_available())
    reason = "DPFAST_SANITIZE=1 (CPU kernels under ASan and UBSan)" if SANITIZE else reason
    log(f"CUDA kernels: {'ON' if with_cuda else 'OFF'} ({reason})")
    # Python's flags carry -g; -g0 after them drops the debug info (most of the file's size)
    cxx = ["-fvisibility=hidden", *(SANITIZE_FLAGS + ["-g", "-O1"] if SANITIZE else ["-O3", "-g" if DEBUG else "-g0"])]
    link = ["-fsanitize=address,undefined"] if SANITIZE else []
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        cxx, link = cxx + ["-fopenmp"], link + ["-fopenmp"]  # else at::parallel_for runs on one thread in our code
    define, args, arch_list = [("DPFAST_BUILT_WITH_TORCH", '"{}"'.format(torch.__version__.split("+")[0]))], {}, None
    files = sources("csrc/*.cpp", "csrc/cpu/*.cpp")
    if with_cuda:
        ce.CUDA_HOME = os.environ["CUDA_HOME"] = root  # torch read it at import, before we chose
        arch_list, why = cuda.choose_arch_list(torch, root)
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        log(f"TORCH_CUDA_ARCH_LIST={arch_list} ({why})")
        files += sources("csrc/cuda/*.cpp", "csrc/cuda/*.cu")
        define += [("DPFAST_WITH_CUDA", None), ("DPFAST_CUDA_ARCH_LIST", f'"{arch_list}"')]
        args["nvcc"] = ["-O3", "--expt-relaxed-constexpr"] + (["-lineinfo"] if DEBUG else [])
    common = dict(include_dirs=[os.path.join(HERE, "csrc")], define_macros=define, extra_link_args=link)
    kind = ce.CUDAExtension if with_cuda else ce.CppExtension
    exts = [kind("dpfast._C", files, extra_compile_args={"cxx": cxx, **args}, **common)]
    if HOOKS:  # host code only
        hooks = sources("csrc/testing/*.cpp")
        exts.append(ce.CppExtension("dpfast._C_hooks", hooks, extra_compile_args={"cxx": cxx}, **common))
    n_cu = sum(f.endswith(".cu") for e in exts for f in e.sources)
    jobs = os.environ.get("MAX_JOBS", "(unset: every core)")
    log(f"compiling {sum(len(e.sources) for e in exts) - n_cu} C++ and {n_cu} CUDA files, MAX_JOBS={jobs}: minutes")
    lacks_only_a_gpu = not with_cuda and mode == "auto" and cuda.decide_cuda(*facts, True)[0]
    record = dict(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_kernels=with_cuda, reason=reason)
    record.update(cuda_arch_list=arch_list, debug=DEBUG or SANITIZE, extension=True, test_hooks=HOOKS)
    return exts, dict(record, cuda_skipped_without_gpu=lacks_only_a_gpu)


def write_record(record: dict, *package_dirs: str) -> None:
    for where in package_dirs:
        with open(os.path.join(where, RECORD), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)


def build_ext_class(record: dict):
    from torch.utils.cpp_extension import BuildExtension

    class TorchBuild(BuildExtension):
        """Objects in ./build, also for editable installs (which would use a temporary folder), so that ninja
        recompiles only what changed; the build record beside the extension (in the tree too, when built there)."""

        def run(self) -> None:
            self.build_temp = os.path.join(HERE, "build", "sanitize" if SANITIZE else "", "temp")
            super().run()
            in_tree = self.inplace or getattr(self, "editable_mode", False)
            write_record(record, os.path.join(self.build_lib, "dpfast"), *[os.path.join(HERE, "dpfast")] * in_tree)

    return TorchBuild.with_options(use_ninja=True)


class PurePythonBuild(build_py):
    def run(self) -> None:  # the record says there is no extension, so dpfast does not look for one
        super().run()
        where = os.path.join(HERE, "dpfast") if self.editable_mode else os.path.join(self.build_lib, "dpfast")
        write_record({"extension": False, "reason": "DPFAST_PURE_PYTHON=1: installed without the compiled ops"}, where)


# examples/ and benchmarks/ ship as dpfast.examples and dpfast.benchmarks: `python -m dpfast demo|bench` installed
SHIPPED_FOLDERS = {"dpfast.examples": "examples", "dpfast.benchmarks": "benchmarks"}


def packages(shipped: bool = True) -> list[str]:
    return sorted(find_packages(HERE, include=["dpfast", "dpfast.*"]) + (list(SHIPPED_FOLDERS) if shipped else []))


def main() -> None:
    import setuptools

    problem = setuptools_problem(setuptools.__version__) or (compiler_problem() if COMPILING else None)
    torch = None if PURE or "sdist" in sys.argv[1:] else import_torch()  # an sdist builds against any torch
    if torch is None and COMPILING and not problem:
        problem = "torch is not installed: install the torch dpfast will run with first, then build against it"
    if problem:
        raise SystemExit(f"[dpfast build] {problem}")
    exts, record = extensions(torch) if torch else ([], {})
    # An editable install (pip install -e) of dpfast's packages alone, from the checkout's root: setuptools then
    # writes a .pth file naming the checkout, which type checkers (mypy, pyright) read, instead of an import hook,
    # which they cannot; the examples and benchmarks are read from the checkout there (dpfast/__main__.py).
    editable = "editable_wheel" in sys.argv[1:]
    setup(
        packages=packages(shipped=not editable),
        package_dir={"": "."} if editable else SHIPPED_FOLDERS,
        install_requires=[torch_requirement(torch.__version__ if exts else None)],
        ext_modules=exts,
        cmdclass={"build_py": PurePythonBuild} if PURE else {"build_ext": build_ext_class(record)} if exts else {},
    )


if __name__ == "__main__":
    main()
