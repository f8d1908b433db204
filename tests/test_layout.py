"""The package's shape: modules small enough to hold in mind, and a one-way pipeline of stage packages (a module
imports only its own stage and earlier ones, so there are no import cycles between stages). The Layout section of
docs/contributing.md lists the same stages, in the same order, and every module of the package."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dpfast"

# The stages of a call, in order: a stage (a package, or a public module) may import only itself and earlier ones.
STAGES = [
    "_flat_layout",  # aliases of the first layout's module paths (imports nothing of dpfast's)
    "ext",  # loading dpfast._C, torch compatibility, the ops' argument checks
    "reference",  # the ops in plain PyTorch (the oracle)
    "ops",  # the fused ops
    "trees",  # values to leaves and specs
    "plan",  # one call's plan: decides, never copies
    "move",  # scatter, gather, broadcast
    "run",  # replicas, workers, turns and collectives, executing a call
    "data_parallel",  # dpfast.DataParallel
    "nn",  # dpfast.nn
    "distributed",  # dpfast.DistributedDataParallel and per-rank loading
    "integrations",  # HF Trainer
    "__main__",  # python -m dpfast
]
TOP = ["__init__"]  # the package's front door: imports what it exports, lazily


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _stage_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_stages(path: pathlib.Path) -> set[str]:
    """The dpfast stages ``path`` imports, relative or absolute (``from ..plan.costs import X`` -> plan)."""
    here = list(path.relative_to(PACKAGE).parent.parts)  # the package path of the module, below dpfast
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                up = node.level - 1
                if up > len(here):
                    continue
                parts = here[: len(here) - up] + (mod.split(".") if mod else [])
            elif mod == "dpfast" or mod.startswith("dpfast."):
                parts = mod.split(".")[1:]
            else:
                continue
            if parts:
                out.add(parts[0])
            else:  # from dpfast import a, b / from .. import a
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dpfast."):
                    out.add(a.name.split(".")[1])
    return out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_400_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 400, f"{path.relative_to(PACKAGE)} has {n} lines; cut it at a natural seam"


def test_every_module_belongs_to_a_stage():
    stray = {str(p.relative_to(PACKAGE)) for p in _modules() if _stage_of(p) not in STAGES + TOP}
    assert not stray, f"modules outside the listed stages: {sorted(stray)}; add their stage to STAGES"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_import_only_their_own_and_earlier_stages(path):
    stage = _stage_of(path)
    if stage in TOP:
        return
    allowed = set(STAGES[: STAGES.index(stage) + 1]) | {"_C", "__version__"}
    later = {s for s in _imported_stages(path) if s not in allowed and (s in STAGES or s in TOP)}
    assert not later, f"dpfast/{path.relative_to(PACKAGE)} ({stage}) imports later stages {sorted(later)}"


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The modules of the package ``path`` imports, as paths below dpfast without ``.py`` (``distributed/inputs``);
    a name imported from a package may be one of its modules. Imports under ``if TYPE_CHECKING:`` count too."""
    here = list(path.relative_to(PACKAGE).parent.parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        mod = node.module or ""
        if node.level:
            if node.level - 1 > len(here):
                continue
            parts = here[: len(here) - (node.level - 1)] + (mod.split(".") if mod else [])
        elif mod.startswith("dpfast."):
            parts = mod.split(".")[1:]
        else:
            continue
        base = "/".join(parts)
        out.add(base)
        out.update(f"{base}/{a.name}" if base else a.name for a in node.names)
    known = {str(p.relative_to(PACKAGE).with_suffix("")) for p in _modules()}
    return {m for m in out if m in known and m != str(path.relative_to(PACKAGE).with_suffix(""))}


def test_no_import_cycles_between_modules():
    """Within a stage too (dpfast/distributed/ once had exchanges and output_layout import each other)."""
    graph = {str(p.relative_to(PACKAGE).with_suffix("")): _imported_modules(p) for p in _modules()}
    for start in graph:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    raise AssertionError(f"an import cycle: {' -> '.join(trail + [nxt])}")
                if nxt not in seen and not nxt.endswith("__init__"):
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))


def test_distributed_uses_only_the_pipeline():
    for path in (PACKAGE / "distributed").glob("*.py"):
        assert "data_parallel" not in _imported_stages(path), path.name


def _readme_layout() -> str:
    """The layout block of docs/contributing.md (the README links to it)."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    section = text.split("\n## The layout\n", 1)[1]
    return section.split("\n```\n", 2)[1] if "\n```\n" in section else section


def test_readme_layout_lists_the_stages_in_order():
    layout = _readme_layout()
    found = []
    for stage in STAGES:
        path = PACKAGE / stage
        name = f"{stage}/" if path.is_dir() else f"{stage}.py"
        m = re.search(rf"(?<![\w/.]){re.escape(name)}", layout)
        assert m, f"docs/contributing.md's Layout section does not list {name}"
        found.append((m.start(), stage))
    order = [s for _, s in sorted(found)]
    assert order == STAGES, "docs/contributing.md's Layout section lists the stages in another order"


def test_readme_layout_names_every_module():
    layout = _readme_layout()
    missing = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if p.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(p.name)}", layout)
    ]
    assert not missing, f"docs/contributing.md's Layout section does not name {missing}"
