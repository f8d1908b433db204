"""The front door, ``dpfast/__init__.py``: every public name and submodule is reachable right after ``import dpfast``,
type checkers see the same names the interpreter does, the exceptions print under the names users catch them by,
and ``import dpfast`` stays cheap and quiet (no transformers, no later pipeline stage, no warning).

Import-time facts are checked in a fresh interpreter: this one has long since imported everything.
"""

from __future__ import annotations

import ast
import importlib
import json
import pickle
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import dpfast

PACKAGE = Path(dpfast.__file__).resolve().parent
INIT = PACKAGE / "__init__.py"

SUBMODULES = ["nn", "ops", "reference", "distributed", "integrations"]
EXCEPTIONS = ["ScatterError", "CollectiveError", "DistributedBatchError"]


def _fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter that imports the dpfast under test (the directory holding it comes first)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _fresh_json(code: str) -> object:
    proc = _fresh(code)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


# ---- what type checkers see ---------------------------------------------------------------------------------------


def _static_imports() -> dict[str, str]:
    """``{exported name: "module:attribute"}`` for the imports under ``if TYPE_CHECKING:`` in dpfast/__init__.py."""
    tree = ast.parse(INIT.read_text())
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1, ast.dump(stmt)
                for alias in stmt.names:
                    name = alias.asname or alias.name
                    if stmt.module is None:  # from . import nn
                        out[name] = f"dpfast.{alias.name}:"
                    else:
                        out[name] = f"dpfast.{stmt.module}:{alias.name}"
    return out


def _eager_names() -> set[str]:
    """Names bound by the module's top-level imports and assignments (what needs no lazy loading)."""
    tree = ast.parse(INIT.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_type_checkers_see_every_exported_name():
    static = set(_static_imports())
    missing = [n for n in dpfast.__all__ if n not in static and n not in _eager_names()]
    assert not missing, f"exported but invisible to type checkers (add them under `if TYPE_CHECKING:`): {missing}"
    extra = static - set(dpfast.__all__)
    assert not extra, f"imported for type checkers but not in __all__: {extra}"
    assert set(dpfast._LAZY) == static, "the lazily loaded names must be the ones imported for type checkers"


def test_static_names_are_the_runtime_objects():
    """Each name the TYPE_CHECKING block imports is, at run time, the very object it names there."""
    for name, target in _static_imports().items():
        module_name, attr = target.split(":")
        module = importlib.import_module(module_name)
        expected = module if not attr else getattr(module, attr)
        assert getattr(dpfast, name) is expected, name


def test_the_lazy_getattr_is_hidden_from_type_checkers():
    """A module ``__getattr__`` that type checkers can see makes every misspelt ``dpfast.X`` an ``Any``."""
    tree = ast.parse(INIT.read_text())
    for node in tree.body:
        assert not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__"), (
            "dpfast.__getattr__ is visible to type checkers: define it under `if not TYPE_CHECKING:`"
        )


# ---- what the interpreter sees ------------------------------------------------------------------------------------

# One fresh interpreter reports what `import dpfast` loads and warns, then reaches each submodule (the lazily loaded
# ones first, each before anything else could have imported it) and every exported name.
_FACTS = """
import json, sys, warnings
import torch
before = set(sys.modules)
with warnings.catch_warnings(record=True) as caught:  # the default filters: what a user would be shown
    import dpfast
added = sorted(set(sys.modules) - before)

def third_party(name):
    path = getattr(sys.modules[name], "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path

facts = {
    "added_dpfast": [m for m in added if m.split(".")[0] == "dpfast"],
    "added_third_party": [m for m in added if m.split(".")[0] not in ("dpfast", "torch") and third_party(m)],
    "added_torch_distributed": [m for m in added if m.startswith("torch.distributed")],
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
}

def attempt(f):
    try:
        return f()
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)

facts["submodules"] = {}
for name in %r:
    loaded = "dpfast." + name in sys.modules
    facts["submodules"][name] = [loaded, attempt(lambda: getattr(dpfast, name).__name__)]
facts["share"] = attempt(lambda: list(dpfast.distributed.shard_range(10, rank=1, world_size=4)))
facts["types"] = {n: attempt(lambda: type(getattr(dpfast, n)).__name__) for n in dpfast.__all__ + ["CallPlan"]}
facts["hf_after_every_name"] = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate"))
print(json.dumps(facts))
"""
LAZY_SUBMODULES = ["distributed", "integrations", "nn"]


@pytest.fixture(scope="module")
def fresh_facts() -> dict:
    return _fresh_json(_FACTS % (LAZY_SUBMODULES + ["ops", "reference"],))


def test_every_public_name_resolves_right_after_import(fresh_facts):
    types = fresh_facts["types"]
    assert all(": " not in t for t in types.values()), types  # each a type name, not an error
    for name in ("CallPlan", "CollectiveError", "DistributedBatchError", "ScatterError", "DataParallel"):
        assert types[name] == "type", name


@pytest.mark.parametrize("name", SUBMODULES)
def test_public_submodules_are_attributes_right_after_import(fresh_facts, name):
    """``import dpfast; dpfast.distributed.shard_range(...)`` works without touching anything else first."""
    loaded_before, module_name = fresh_facts["submodules"][name]
    assert module_name == f"dpfast.{name}"
    assert name in dpfast.__all__
    if name in LAZY_SUBMODULES:
        assert not loaded_before, f"dpfast.{name} was imported before it was touched: the check proves nothing"


def test_distributed_helpers_work_right_after_import(fresh_facts):
    assert fresh_facts["share"] == [3, 4, 5]


def test_integrations_transformers_is_an_attribute():
    """``dpfast.integrations.transformers`` resolves as an attribute (importing transformers only then: the fresh
    interpreter above reached every public name without importing it)."""
    pytest.importorskip("transformers")
    import dpfast.integrations as integrations

    module = integrations.__getattr__("transformers")  # what the attribute access calls when it is not loaded yet
    assert module is importlib.import_module("dpfast.integrations.transformers")
    assert module.DataParallelTrainer.__module__ == "dpfast.integrations.transformers"
    with pytest.raises(AttributeError, match="'dpfast.integrations' has no attribute 'torchvision'"):
        integrations.torchvision  # noqa: B018


def test_unknown_names_are_an_attribute_error_naming_them():
    with pytest.raises(AttributeError, match="module 'dpfast' has no attribute 'DataParalel'"):
        dpfast.DataParalel  # noqa: B018


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_exceptions_print_and_pickle_under_the_name_users_catch(name):
    cls = getattr(dpfast, name)
    assert cls.__module__ == "dpfast"
    line = traceback.format_exception_only(cls, cls("what went wrong"))[-1]
    assert line == f"dpfast.{name}: what went wrong\n"
    back = pickle.loads(pickle.dumps(cls("what went wrong")))
    assert type(back) is cls and str(back) == "what went wrong"


def test_exception_hierarchy():
    assert issubclass(dpfast.ScatterError, ValueError)
    assert issubclass(dpfast.DistributedBatchError, dpfast.ScatterError)
    assert issubclass(dpfast.CollectiveError, RuntimeError)
    assert dpfast.distributed.DistributedBatchError is dpfast.DistributedBatchError


def test_plan_returns_the_exported_call_plan():
    import torch

    dp = dpfast.DataParallel(torch.nn.Linear(3, 2), ["cpu"] * 2)
    assert isinstance(dp.plan(torch.zeros(4, 3)), dpfast.CallPlan)


def test_build_info_has_exactly_the_declared_keys_and_types():
    """``BuildInfo`` is what type checkers read for ``build_info()``: it must not drift from what it returns."""
    from dpfast.ext.loader import BuildInfo

    types = {"str": str, "bool": bool, "int": int, "None": type(None)}
    annotations = {k: getattr(v, "__forward_arg__", v) for k, v in BuildInfo.__annotations__.items()}  # strings
    declared = {k: tuple(types[t] for t in v.split(" | ")) for k, v in annotations.items()}
    info = dpfast.build_info()
    assert list(info) == list(declared)
    for key, value in info.items():
        assert isinstance(value, declared[key]), (key, value, declared[key])


# ---- cheap and quiet --------------------------------------------------------------------------------------------

# What `import dpfast` may load beyond torch itself: the front door, the extension and the ops (they register
# torch.ops.dpfast), nothing of the later stages, no part of torch.distributed that torch itself did not load, and no
# other third-party package (standard library modules, and torch modules that torch loads lazily, are fine).
EAGER = {
    "dpfast",
    "dpfast._flat_layout",
    "dpfast.ext",
    "dpfast.ext.loader",
    "dpfast.ext.op_checks",
    "dpfast.ops",
    "dpfast.reference",
}


def test_import_loads_nothing_beyond_the_ops(fresh_facts):
    extension = {"dpfast._C"} if dpfast.build_info()["extension_loaded"] else set()
    assert set(fresh_facts["added_dpfast"]) == EAGER | extension
    assert fresh_facts["added_third_party"] == []
    assert fresh_facts["added_torch_distributed"] == []


def test_reaching_every_public_name_never_imports_transformers(fresh_facts):
    """Only ``dpfast.integrations.transformers`` may import transformers, and only when it is touched."""
    assert fresh_facts["hf_after_every_name"] == []


def test_import_is_warning_free(fresh_facts):
    if not dpfast.build_info()["extension_loaded"]:
        pytest.skip("without dpfast._C, import dpfast warns once by design (the plain-PyTorch fallback)")
    assert fresh_facts["warnings"] == []
