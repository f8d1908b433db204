"""How dpfast is built and installed: setup.py's decisions, the sdist, the build record, the installed package.

setup.py's helpers are tested directly (it is importable; ``setup()`` only runs as a script). Tests that need a
checkout skip outside one; tests of the installed package skip in a checkout, and CI runs them against the
installed wheel (``.ci/check_dist.sh``) and the torch 2.4 install (``.ci/check_oldest_torch.sh``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import dpfast
from dpfast.ext import loader as _extension

PACKAGE = Path(dpfast.__file__).resolve().parent
# the tests' own source tree (a checkout or an unpacked sdist), which may differ from where dpfast is imported from
TREE = Path(__file__).resolve().parent.parent
HAS_SETUP = (TREE / "setup.py").is_file()
INSTALLED = not _extension._IN_CHECKOUT

needs_setup = pytest.mark.skipif(not HAS_SETUP, reason="needs dpfast's source tree (setup.py)")
needs_install = pytest.mark.skipif(
    not INSTALLED,
    reason="dpfast is imported from a checkout; CI runs this against the installed wheel (.ci/check_dist.sh)",
)


@pytest.fixture(scope="module")
def setup_py():
    if not HAS_SETUP:
        pytest.skip("needs dpfast's source tree (setup.py)")
    spec = importlib.util.spec_from_file_location("dpfast_setup", TREE / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the helpers; setup() runs only under __main__
    return module


# ---- the sdist --------------------------------------------------------------------------------------------------


def _tracked_files() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=TREE, capture_output=True, text=True, timeout=60)
    except OSError:
        pytest.skip("git is not installed")
    if out.returncode != 0:
        pytest.skip("not a git checkout (e.g. an unpacked sdist)")
    return {f for f in out.stdout.splitlines() if (TREE / f).is_file()}  # (a file deleted but not committed)


@needs_setup
def test_sdist_holds_every_tracked_file_whatever_the_building_machine(tmp_path):
    """Built CPU-only: setuptools alone would leave out every header, the CUDA files, tests, examples, benchmarks."""
    tracked = _tracked_files()
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setup.py refuses setuptools {setuptools.__version__} (< 77)")
    env = dict(os.environ, DPFAST_CUDA="0")
    commands = ["egg_info", "--egg-base", str(tmp_path), "sdist", "--dist-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", *commands],
        cwd=TREE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (archive,) = tmp_path.glob("dpfast-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(tracked - names - {".gitignore"})
    assert not missing, f"the sdist lacks {missing}"
    assert any(n.startswith("csrc/cuda/") and n.endswith(".cu") for n in names)
    built = sorted(n for n in names if n.endswith((".so", ".o", ".pyc")) or n.endswith("_build.json"))
    assert not built, f"build outputs of this tree in the sdist: {built}"
    with tarfile.open(archive) as tar:
        pkg_info = tar.extractfile(f"{archive.name[: -len('.tar.gz')]}/PKG-INFO").read().decode()
    assert "Requires-Dist: torch>=2.4" in pkg_info  # an sdist builds against any supported torch


# ---- setup.py's decisions ---------------------------------------------------------------------------------------


def test_old_setuptools_is_refused_with_what_to_install(setup_py):
    problem = setup_py.setuptools_problem("65.5.0")
    assert re.search(r"setuptools 65\.5\.0 is too old.*pip install 'setuptools>=77' wheel ninja", problem)
    assert setup_py.setuptools_problem("77.0.3") is None and setup_py.setuptools_problem("80.9.0") is None


def test_wheel_requires_the_torch_release_line_it_was_built_against(setup_py):
    assert setup_py.torch_requirement("2.14.1+cu130") == "torch==2.14.*"
    assert setup_py.torch_requirement("2.4.0") == "torch==2.4.*"
    assert setup_py.torch_requirement(None) == "torch>=2.4"


@pytest.fixture
def toolkit(tmp_path):
    """A folder that looks like a CUDA toolkit to decide_cuda (it has include/cuda_runtime.h)."""
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    return str(tmp_path)


def test_toolkit_of_another_cuda_major_than_torch_builds_cpu_only_or_fails_naming_both(setup_py, toolkit):
    facts = ("2.8.0+cu128", "12.8", toolkit, "nvcc on PATH", "13.0", True)
    on, reason = setup_py.cuda.decide_cuda("auto", *facts)
    assert not on
    assert "CUDA 13.0" in reason and "built for CUDA 12.8" in reason and "CUDA_HOME" in reason
    with pytest.raises(SystemExit, match=r"DPFAST_CUDA=1 .*CUDA 13\.0 .*CUDA 12\.8"):
        setup_py.cuda.decide_cuda("1", *facts)
    on, reason = setup_py.cuda.decide_cuda("auto", "2.14.1+cu130", "13.0", toolkit, "nvcc on PATH", "13.0", True)
    assert on and "torch CUDA 13.0" in reason
    assert setup_py.cuda.decide_cuda("auto", "2.14.1+cu130", "13.0", toolkit, "CUDA_HOME", "13.2", True)[0]


def test_missing_toolkit_or_cpu_torch(setup_py, tmp_path):
    on, reason = setup_py.cuda.decide_cuda("auto", "2.4.0+cpu", None, None, "no nvcc", None, True)
    assert not on and "CPU-only build" in reason and "no CUDA toolkit" in reason
    with pytest.raises(SystemExit, match="DPFAST_CUDA=1 but CUDA kernels cannot be built"):
        setup_py.cuda.decide_cuda("1", "2.14.1+cu130", "13.0", None, "no nvcc", None, True)
    with pytest.raises(SystemExit, match=f"{tmp_path} \\(CUDA_HOME=x\\) is no CUDA toolkit"):  # no cuda_runtime.h
        setup_py.cuda.decide_cuda("1", "2.14.1+cu130", "13.0", str(tmp_path), "CUDA_HOME=x", "13.0", True)
    assert setup_py.cuda.decide_cuda("0", "2.14.1+cu130", "13.0", None, "", None, True) == (False, "DPFAST_CUDA=0")
    with pytest.raises(SystemExit, match="DPFAST_CUDA='yes' is not one of auto, 1, 0"):
        setup_py.cuda.decide_cuda("yes", "2.14.1", "13.0", None, "", None, True)


def test_auto_compiles_no_cuda_kernels_that_could_not_run_here(setup_py, toolkit):
    """nvcc but no GPU (a newcomer's laptop, this CI machine): minutes of nvcc for kernels nothing here can run.
    DPFAST_CUDA=1 still compiles them (CI, a wheel for GPU machines)."""
    facts = ("2.14.1+cu130", "13.0", toolkit, "nvcc on PATH", "13.0")
    on, reason = setup_py.cuda.decide_cuda("auto", *facts, False)
    assert not on and "no GPU is visible" in reason and "DPFAST_CUDA=1 compiles them anyway" in reason
    assert setup_py.cuda.decide_cuda("1", *facts, False)[0]
    assert setup_py.cuda.decide_cuda("auto", *facts, True)[0]


def test_cpu_extension_and_its_record(setup_py, monkeypatch):
    """What setup.py builds with DPFAST_CUDA=0: the CPU sources only, no test hooks in dpfast._C, and a record that
    says so (the GPU check builds through these same functions where setuptools is too old for pyproject.toml)."""
    monkeypatch.setenv("DPFAST_CUDA", "0")
    exts, record = setup_py.extensions(torch)
    assert exts[0].name == "dpfast._C" and [e.name for e in exts[1:]] == ["dpfast._C_hooks"] * setup_py.HOOKS
    assert not [f for f in exts[0].sources if "cuda" in f or "testing" in f] and "csrc/dpfast.cpp" in exts[0].sources
    assert record["reason"] == "DPFAST_CUDA=0" and record["cuda_kernels"] is False and record["extension"] is True
    assert record["torch"] == torch.__version__ and record["cuda_skipped_without_gpu"] is False
    assert issubclass(setup_py.build_ext_class(record), __import__("setuptools").Command)


def test_default_arch_list_is_torchs_architectures_that_nvcc_supports(setup_py):
    torch_archs = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_90a", "sm_100", "sm_120"]
    nvcc_archs = ["compute_75", "compute_80", "compute_86", "compute_89", "compute_90", "compute_100"]
    assert setup_py.cuda.default_arch_list(torch_archs, nvcc_archs) == "7.5;8.0;8.6;9.0;10.0+PTX"
    assert setup_py.cuda.default_arch_list(torch_archs, []) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"  # nvcc did not say
    assert setup_py.cuda.default_arch_list(["sm_50"], ["compute_90"]) is None


def test_arch_list_without_a_gpu_is_one_torch_accepts(setup_py, monkeypatch):
    """torch's own pick, with TORCH_CUDA_ARCH_LIST unset and no GPU, raises IndexError (torch 2.14)."""
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU-only build")
    root, _ = setup_py.cuda.find_cuda_home()
    if root is None:
        pytest.skip("no CUDA toolkit")
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    arch_list, why = setup_py.cuda.choose_arch_list(torch, root)
    assert arch_list.endswith("+PTX") and "no GPU visible" in why
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    flags = cpp_extension._get_cuda_arch_flags()
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert any(re.fullmatch(r"-gencode=arch=compute_(\d+),code=compute_\1", f) for f in flags)  # +PTX
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert setup_py.cuda.choose_arch_list(torch, root) == ("9.0", "TORCH_CUDA_ARCH_LIST")


def test_toolkit_version_is_read_from_nvcc(setup_py):
    root, how = setup_py.cuda.find_cuda_home()
    if root is None:
        pytest.skip("no CUDA toolkit")
    # also where `nvcc` is a wrapper script (here: /usr/local/bin/nvcc), whose folder torch's own guess takes
    assert os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")), (root, how)
    assert re.fullmatch(r"\d+\.\d+", setup_py.cuda.nvcc_version(root) or "")


# ---- the build record and the built-against torch ---------------------------------------------------------------


def test_mismatch_names_both_torches():
    record = {"torch": "2.14.1+cu130", "torch_cuda": "13.0", "cuda_kernels": True}
    assert _extension.torch_mismatch(record, "2.14.1+cu130", "13.0") is None
    assert _extension.torch_mismatch(record, "2.14.0+cu130", "13.2") is None  # patch releases share the ABI
    assert _extension.torch_mismatch(None, "2.4.0", None) is None  # no record: try to load it
    msg = _extension.torch_mismatch(record, "2.4.0+cu121", "12.1")
    assert msg == "was built against torch 2.14.1+cu130, but this is torch 2.4.0+cu121"
    msg = _extension.torch_mismatch(record, "2.14.1+cpu", None)
    assert "CUDA kernels built against torch 2.14.1+cu130 (CUDA 13.0)" in msg and "a CPU-only build" in msg
    cpu_record = dict(record, cuda_kernels=False)
    assert _extension.torch_mismatch(cpu_record, "2.14.1+cpu", None) is None  # CPU kernels run on either build


def _import_copy(tmp_path, record: dict, **env) -> subprocess.CompletedProcess:
    """``import dpfast`` from a copy of the package under test whose build record says ``record``."""
    shutil.copytree(PACKAGE, tmp_path / "dpfast", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "dpfast" / "_build.json").write_text(json.dumps(record))
    code = "import json, dpfast; print(json.dumps(dpfast.build_info()))"
    env = {k: v for k, v in os.environ.items() if k not in ("DPFAST_REQUIRE_EXTENSION", "DPFAST_NO_EXTENSION")} | env
    env["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_extension_built_for_another_torch_is_not_loaded_and_says_how_to_rebuild(tmp_path):
    record = {"torch": "2.3.1+cu118", "torch_cuda": "11.8", "cuda_kernels": True, "reason": "DPFAST_CUDA=1; ..."}
    proc = _import_copy(tmp_path / "warn", record)
    assert proc.returncode == 0, proc.stderr
    assert f"built against torch 2.3.1+cu118, but this is torch {torch.__version__}" in proc.stderr
    assert "RuntimeWarning" in proc.stderr and "pip install --no-build-isolation" in proc.stderr
    facts = json.loads(proc.stdout)
    assert not facts["extension_loaded"] and facts["ops_backend"].startswith("dpfast.reference")
    assert facts["build_reason"] == "DPFAST_CUDA=1; ..." and facts["built_with_torch"] == "2.3.1+cu118"

    proc = _import_copy(tmp_path / "require", record, DPFAST_REQUIRE_EXTENSION="1")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "built against torch 2.3.1+cu118" in proc.stderr


def test_extension_built_without_a_gpu_warns_where_there_is_one(tmp_path):
    """DPFAST_CUDA=auto leaves the CUDA kernels out where no GPU is visible (a container build, say); on a machine
    with a GPU that extension cannot take CUDA tensors, and says so at import, with what to do."""
    if not _extension.LOADED:
        pytest.skip("the extension is not built")
    record = dict(_extension.RECORD or {}, cuda_kernels=False, cuda_skipped_without_gpu=True, torch=torch.__version__)
    shutil.copytree(PACKAGE, tmp_path / "dpfast", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "dpfast" / "_build.json").write_text(json.dumps(record))
    code = "import torch\ntorch.cuda.is_available = lambda: {}\nimport dpfast"
    env = {k: v for k, v in os.environ.items() if k != "DPFAST_REQUIRE_EXTENSION"} | {"PYTHONPATH": str(tmp_path)}
    for gpu in (True, False):
        proc = subprocess.run(
            [sys.executable, "-W", "always", "-c", code.format(gpu)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        warned = "built without its CUDA kernels because no GPU was visible" in proc.stderr
        assert warned == gpu and (not gpu or "DPFAST_CUDA=1" in proc.stderr), proc.stderr[-2000:]


def test_build_record_says_why_and_is_reported():
    if not _extension.LOADED:
        pytest.skip("the extension is not built")
    if _extension.RECORD is None:
        pytest.skip("a build without setup.py's record (make sanitize)")
    facts = dpfast.build_info()
    assert facts["build_reason"] and facts["build_reason"] == _extension.RECORD["reason"]
    assert facts["built_with_torch"] == torch.__version__.split("+")[0]
    assert _extension.RECORD["torch"] == torch.__version__
    assert bool(_extension.RECORD["cuda_kernels"]) == facts["cuda_kernels_compiled"]
    assert _extension.RECORD["extension"] is True and isinstance(_extension.RECORD["test_hooks"], bool)


def test_the_extension_carries_no_test_hooks():
    """They are dpfast._C_hooks, built only for the tests (DPFAST_TEST_HOOKS=1): a release _C has none."""
    if not _extension.LOADED:
        pytest.skip("the extension is not built")
    assert not [n for n in dir(_extension.C) if n in ("_replay_cuda_copy", "_job_offsets", "_node_streams")]


def test_release_build_carries_no_debug_info():
    if not _extension.LOADED:
        pytest.skip("the extension is not built")
    if (_extension.RECORD or {}).get("debug"):
        pytest.skip("built with DPFAST_DEBUG=1")
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed")
    sections = subprocess.run([readelf, "-S", "-W", _extension.C.__file__], capture_output=True, text=True).stdout
    assert ".debug_info" not in sections


# ---- package metadata and typing --------------------------------------------------------------------------------


def test_version_is_exposed_and_reported():
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev)?\d*", dpfast.__version__)
    assert dpfast.build_info()["dpfast_version"] == dpfast.__version__


def test_package_is_typed_with_a_stub_for_the_extension():
    assert (PACKAGE / "py.typed").is_file()
    stub = (PACKAGE / "_C.pyi").read_text()
    if not _extension.LOADED:
        pytest.skip("the extension is not built")
    names = {n for n in dir(_extension.C) if not n.startswith("__")}
    tree = ast.parse(stub)
    declared = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    declared |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    assert names == declared, f"in dpfast._C but not in _C.pyi: {names - declared}; stale: {declared - names}"


def test_every_package_on_disk_ships(setup_py):
    on_disk = {
        ".".join(("dpfast", *p.parent.relative_to(TREE / "dpfast").parts))
        for p in (TREE / "dpfast").rglob("__init__.py")
    }
    assert on_disk <= set(setup_py.packages())
    assert {"dpfast.examples", "dpfast.benchmarks"} <= set(setup_py.packages())


@needs_setup
def test_project_metadata():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((TREE / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    assert "BSD 3-Clause License" in (TREE / "LICENSE").read_text()
    assert project["authors"] and any(c.startswith("Programming Language :: Python") for c in project["classifiers"])
    assert set(project["dynamic"]) == {"version", "dependencies"} and project["readme"] == "README.md"


# ---- the installed package --------------------------------------------------------------------------------------


@needs_install
def test_installed_package_carries_examples_benchmarks_record_and_types():
    for name in (
        "examples/__init__.py",
        "examples/_common.py",
        "examples/rrn.py",
        "examples/transformer.py",
        "examples/rrn_fused_state.py",
        "benchmarks/bench_ops.py",
        "benchmarks/bench_dp.py",
        "py.typed",
        "_C.pyi",
        "_build.json",
    ):
        assert (PACKAGE / name).is_file(), name


@needs_install
def test_installed_metadata_pins_the_torch_it_was_built_with():
    requires = importlib.metadata.requires("dpfast") or []
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert f"torch=={major_minor}.*" in requires, requires
    assert importlib.metadata.version("dpfast") == dpfast.__version__
    assert importlib.metadata.metadata("dpfast")["License-Expression"] == "BSD-3-Clause"


def test_cli_bench_finds_its_scripts():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for which in ("ops", "dp"):
        proc = subprocess.run(
            [sys.executable, "-m", "dpfast", "bench", which, "--help"],
            cwd=PACKAGE.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "--quick" in proc.stdout and "not found" not in proc.stderr


def test_cli_bench_forwards_options_with_values_without_a_benchmark_name(tmp_path, monkeypatch, capsys):
    import dpfast.__main__ as cli

    for name in ("bench_ops.py", "bench_dp.py"):
        (tmp_path / name).write_text("def main(argv=None):\n    print('got', argv)\n    return 0\n")
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", tmp_path)
    assert cli.main(["bench", "--quick", "--out", str(tmp_path / "results")]) == 0
    assert capsys.readouterr().out.count(f"got ['--quick', '--out', '{tmp_path / 'results'}']") == 2


def _development_install() -> Path | None:
    """The .pth file of dpfast's development install (``pip install -e``) in this interpreter's site-packages."""
    import site

    found = [p for d in site.getsitepackages() for p in Path(d).glob("__editable__.dpfast-*.pth")]
    return found[0] if found else None


def test_a_type_checker_sees_the_development_install_from_outside_the_checkout(tmp_path):
    """Was: ``mypy --strict`` on user code outside the checkout reported ``Cannot find implementation or library stub
    for module named "dpfast"`` (setuptools' editable import hook is invisible to type checkers), so a subclass of
    ``dpfast.DataParallel`` subclassed ``Any``. The development install is now a path in a .pth file."""
    pth = _development_install()
    if pth is None:
        pytest.skip("dpfast is not installed in development mode (pip install -e) here")
    assert pth.read_text().split() == [str(TREE)]  # a path, which mypy and pyright read; no import hook
    pytest.importorskip("mypy")
    user = tmp_path / "train.py"
    user.write_text(
        "from torch import nn\n\nimport dpfast\n\n\n"
        "class Mine(dpfast.DataParallel):\n    pass\n\n\n"
        "wrapper: nn.DataParallel[nn.Module] = Mine(nn.Linear(2, 2), ['cpu'] * 2)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    cache = TREE / ".mypy_cache"  # (what `make typecheck` read of torch already, if it ran)
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), str(user)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
