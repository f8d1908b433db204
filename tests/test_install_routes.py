"""Installs as a newcomer meets them: `pip install` of a copy of the source tree into a folder of its own, where
there is no C++ compiler, or with the documented switch for a pure-Python install (DPFAST_PURE_PYTHON=1).

Neither compiles anything, so each takes seconds; both need the source tree and a setuptools that can read
pyproject.toml (>= 77), and pip builds with this environment's torch (--no-build-isolation, nothing downloaded).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TREE = Path(__file__).resolve().parent.parent
# what a copy of the tree leaves out: build outputs and local state, which a fresh checkout does not have
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "*.so",
    "_build.json",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "results",
)


@pytest.fixture
def source(tmp_path) -> Path:
    if not (TREE / "setup.py").is_file():
        pytest.skip("needs dpfast's source tree (setup.py)")
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setup.py refuses setuptools {setuptools.__version__} (< 77)")
    shutil.copytree(TREE, tmp_path / "src", ignore=NOT_SOURCES)
    return tmp_path / "src"


def pip_install(source: Path, target: Path, **env: str) -> subprocess.CompletedProcess:
    """`pip install` of the tree into `target`, as a user runs it (no -v: pip shows a build's output on failure)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPFAST_") and k != "CXX"} | env
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index"]
    return subprocess.run(
        [*cmd, "--target", str(target), str(source)], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("cxx", [None, "/nowhere/g++"], ids=["no c++ on PATH", "CXX names no program"])
def test_no_compiler_stops_with_one_line_saying_what_to_install(source, tmp_path, cxx):
    """Before: about 200 lines ending in torch's CalledProcessError, with `c++: not found` buried in them."""
    bare = tmp_path / "bin"  # a PATH without any compiler (pip and setup.py run from sys.executable)
    bare.mkdir()
    env = {"PATH": str(bare)} | ({"CXX": cxx} if cxx else {})
    proc = pip_install(source, tmp_path / "site", **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    ours = [line.strip() for line in out.splitlines() if "[dpfast build]" in line]
    assert len(ours) == 1, out
    assert "no C++ compiler" in ours[0] and "apt install g++" in ours[0] and "DPFAST_PURE_PYTHON=1 pip" in ours[0]
    assert (f"CXX={cxx!r} is not a program" if cxx else "no `c++` on PATH") in ours[0]
    assert "Traceback" not in out and "CalledProcessError" not in out
    assert len(out.splitlines()) < 30, out  # pip's own frame around that one line


def test_pure_python_install_imports_warns_once_and_runs_on_the_reference(source, tmp_path):
    site = tmp_path / "site"
    proc = pip_install(source, site, DPFAST_PURE_PYTHON="1", PATH=str(tmp_path))  # no compiler needed either
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(site.glob("dpfast/_C*.so")), "a pure-Python install holds no extension"
    (dist_info,) = site.glob("dpfast-*.dist-info")
    assert "Requires-Dist: torch>=2.4" in (dist_info / "METADATA").read_text()  # any torch: nothing compiled
    assert json.loads((site / "dpfast" / "_build.json").read_text())["extension"] is False
    code = textwrap.dedent(
        """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch, dpfast
            x = torch.randn(6, 4)
            h = torch.randn(2, 6, 3)
            dp = dpfast.DataParallel(torch.nn.Linear(4, 2), ["cpu"] * 2)
            assert torch.equal(dp(x), dp.module(x))
            assert torch.equal(dpfast.ops.transpose01(h)[0], h.transpose(0, 1).contiguous())
        print(json.dumps({"file": dpfast.__file__, "info": dpfast.build_info(),
                          "warnings": [str(w.message) for w in caught if "dpfast" in str(w.message)]}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DPFAST_REQUIRE_EXTENSION", "DPFAST_NO_EXTENSION")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.splitlines()[-1])
    assert facts["file"].startswith(str(site))
    info = facts["info"]
    assert not info["extension_loaded"] and info["ops_backend"].startswith("dpfast.reference")
    assert "DPFAST_PURE_PYTHON=1" in info["extension_error"] and "DPFAST_PURE_PYTHON=1" in info["build_reason"]
    (warning,) = facts["warnings"]  # once, at import; not once per call
    assert "falls back to the plain-PyTorch dpfast.reference" in warning and "DPFAST_PURE_PYTHON=1" in warning

    strict = subprocess.run(
        [sys.executable, "-c", "import dpfast"],
        cwd=tmp_path,
        env=env | {"DPFAST_REQUIRE_EXTENSION": "1"},
        capture_output=True,
        text=True,
    )
    assert strict.returncode != 0 and "DPFAST_PURE_PYTHON=1" in strict.stderr  # CI's guard still holds
