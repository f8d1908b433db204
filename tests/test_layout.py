"""The package's shape: modules small enough to hold in mind, and a one-way pipeline (no module imports a later
stage, so there are no import cycles)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dpfast"

# The stages of a call, in order: a module may import only modules listed before it.
PIPELINE = [
    "_extension",
    "_compat",
    "_op_checks",
    "reference",
    "ops",
    "_nodes",
    "_tree",
    "_nested",
    "_specs",
    "_binding",
    "_splits",
    "_costs",
    "_render",
    "_errors",
    "_planning",
    "_transfer",
    "_gather",
    "_broadcast",
    "_replicas",
    "_workers",
    "_rendezvous",
    "_collectives",
    "_execute",
    "data_parallel",
    "_sync_batchnorm",
    "nn",
]


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_400_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 400, f"{path.relative_to(PACKAGE)} has {n} lines; cut it at a natural seam"


def _imported_stages(path: pathlib.Path) -> set[str]:
    """The dpfast top-level modules ``path`` imports (relative or absolute)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            # `from . import x` in dpfast/, `from .. import x` in a subpackage: a top-level module of dpfast
            if (node.level == 1 and path.parent == PACKAGE) or node.level == 2:
                names = [mod.split(".")[0]] if mod else [a.name for a in node.names]
            elif mod.startswith("dpfast."):
                names = [mod.split(".")[1]]
            else:
                continue
            out.update(names)
    return out


@pytest.mark.parametrize("name", PIPELINE)
def test_pipeline_modules_import_only_earlier_stages(name):
    allowed = set(PIPELINE[: PIPELINE.index(name)])
    later = {m for m in _imported_stages(PACKAGE / f"{name}.py") if m in PIPELINE and m not in allowed}
    assert not later, f"dpfast/{name}.py imports later stages {sorted(later)}"


def test_distributed_uses_only_the_pipeline():
    for path in (PACKAGE / "distributed").glob("*.py"):
        assert "data_parallel" not in _imported_stages(path), path.name
