"""The public API's docstrings, as ``help()`` and the docs site (mkdocstrings, Google style) show them: every public
function and method has its own docstring (not torch's, inherited) with ``Args:`` naming exactly its parameters,
``Returns:`` (unless it returns ``None``) and ``Raises:``; every class its users construct documents its constructor's
parameters under ``Args:`` and what it raises under ``Raises:``; the types a call returns (``CallPlan``, ``Share``)
document their fields under ``Attributes:``; the exceptions say when they are raised; every property has a docstring
of its own.

The public names are read from the ``__all__`` of the public modules, so a name added there is covered at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

import dpfast

PUBLIC_MODULES = ["dpfast", "dpfast.ops", "dpfast.reference", "dpfast.nn", "dpfast.distributed"]
if importlib.util.find_spec("transformers") is not None:  # optional: torch 2.4's CI leg does not install it
    PUBLIC_MODULES.append("dpfast.integrations.transformers")

RESULT_TYPES = {"CallPlan", "Share"}  # returned to users, never built by them: their fields are documented instead


def _public_objects():
    """``(qualified name, object)`` of every public function and class, each once (dpfast.DataParallelTrainer...)."""
    seen, out = set(), []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            out.append((f"{module_name}.{name}", obj))
    return out


PUBLIC = _public_objects()
CLASSES = [(n, c) for n, c in PUBLIC if inspect.isclass(c)]
EXCEPTIONS = [(n, c) for n, c in CLASSES if issubclass(c, BaseException)]
RESULTS = [(n, c) for n, c in CLASSES if c.__name__ in RESULT_TYPES]
CONSTRUCTED = [(n, c) for n, c in CLASSES if (n, c) not in EXCEPTIONS and (n, c) not in RESULTS]


def _own_methods(cls):
    """The class's own public methods (``vars``: an inherited torch docstring does not count), ``forward`` included."""
    for name, value in vars(cls).items():
        if name.startswith("_") or isinstance(value, property):
            continue
        if isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            yield name, value


FUNCTIONS = [(n, f) for n, f in PUBLIC if not inspect.isclass(f)] + [
    (f"{n}.{m}", f) for n, c in CLASSES if (n, c) not in EXCEPTIONS for m, f in _own_methods(c)
]
PROPERTIES = [
    (f"{n}.{k}", v) for n, c in CLASSES for k, v in vars(c).items() if isinstance(v, property) and not k.startswith("_")
]

SECTION = re.compile(r"^(?P<indent> *)(?P<name>Args|Attributes|Returns|Raises|Yields|Examples?|Notes?):\s*$", re.M)


def _sections(doc: str) -> dict[str, str]:
    """Google-style sections of a docstring: ``{"Args": body, ...}``."""
    marks = list(SECTION.finditer(doc))
    out = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        out[m["name"]] = doc[m.end() : nxt.start() if nxt else len(doc)]
    return out


def _documented_args(body: str) -> list[str]:
    """The parameter names an ``Args:`` section lists (``name: ...``, ``name (type): ...``, ``*args: ...``)."""
    lines = [line for line in body.splitlines() if line.strip()]
    if not lines:
        return []
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    names = []
    for line in lines:
        if len(line) - len(line.lstrip()) == indent:
            m = re.match(r"\s*(\*{0,2}\w+)(?: \([^)]*\))?:", line)
            assert m, f"not an `name: description` entry: {line!r}"
            names.append(m.group(1))
    return names


def _parameters(fn, skip_first: bool = False) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())
    if skip_first:
        params = params[1:]
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [prefix.get(p.kind, "") + p.name for p in params]


def _doc(obj) -> str:
    doc = obj.__doc__
    assert doc and doc.strip(), "no docstring of its own"
    return inspect.cleandoc(doc)


def _returns_none(fn) -> bool:
    return inspect.signature(fn).return_annotation in (None, "None")


@pytest.mark.parametrize("name,fn", FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_functions_document_args_returns_raises(name, fn):
    sections = _sections(_doc(fn))
    method = not isinstance(fn, staticmethod) and name.count(".") > 1 and inspect.isclass(_owner(name))
    fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
    params = _parameters(fn, skip_first=method)
    if params:
        assert "Args" in sections, f"{name}: no Args: section"
        assert _documented_args(sections["Args"]) == params, f"{name}: Args: must list {params}, in order"
    if not _returns_none(fn):
        assert "Returns" in sections, f"{name}: no Returns: section"
    assert "Raises" in sections, f"{name}: no Raises: section (say what it raises, and when)"
    assert sections["Raises"].strip(), f"{name}: empty Raises: section"


def _owner(name: str):
    module_name, cls_name = name.rsplit(".", 2)[:2]
    return getattr(importlib.import_module(module_name), cls_name, None)


@pytest.mark.parametrize("name,cls", CONSTRUCTED, ids=[n for n, _ in CONSTRUCTED])
def test_classes_document_their_constructor(name, cls):
    """Every constructor parameter, in order, and what the constructor raises. (A constructor that is torch's may
    take parameters that older torch releases lack, such as BatchNorm's ``bias``: the docstring may name those too.)"""
    sections = _sections(_doc(cls))
    assert "Args" in sections, f"{name}: no Args: section for the constructor"
    params = _parameters(cls.__init__, skip_first=True)
    documented = [a for a in _documented_args(sections["Args"]) if a in params]
    assert documented == params, f"{name}: Args: must list {params}, in order"
    assert "Raises" in sections and sections["Raises"].strip(), f"{name}: no Raises: section for the constructor"


@pytest.mark.parametrize("name,cls", RESULTS, ids=[n for n, _ in RESULTS])
def test_result_types_document_their_fields(name, cls):
    sections = _sections(_doc(cls))
    assert "Attributes" in sections, f"{name}: no Attributes: section"
    fields = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else list(cls._fields)
    assert _documented_args(sections["Attributes"]) == fields, f"{name}: Attributes: must list {fields}, in order"


@pytest.mark.parametrize("name,cls", EXCEPTIONS, ids=[n for n, _ in EXCEPTIONS])
def test_exceptions_say_when_they_are_raised(name, cls):
    doc = _doc(cls)
    assert "raised" in doc.lower(), f"{name}: say when it is raised"
    if "__init__" in vars(cls):  # a constructor of its own: its parameters, as for any class
        params = _parameters(cls.__init__, skip_first=True)
        assert _documented_args(_sections(doc)["Args"]) == params, f"{name}: Args: must list {params}, in order"


@pytest.mark.parametrize("name,prop", PROPERTIES, ids=[n for n, _ in PROPERTIES])
def test_properties_have_a_docstring_of_their_own(name, prop):
    assert prop.fget.__doc__ and prop.fget.__doc__.strip(), f"{name}: no docstring"


def test_every_public_name_is_covered():
    """The lists above are read from ``__all__``; this keeps them from silently shrinking."""
    names = {n for n, _ in PUBLIC}
    for expected in ("dpfast.DataParallel", "dpfast.CallPlan", "dpfast.all_gather", "dpfast.CollectiveError",
                     "dpfast.distributed.BalancedBatchSampler", "dpfast.distributed.shard_batch", "dpfast.build_info",
                     "dpfast.nn.SyncBatchNorm", "dpfast.ops.gather"):  # fmt: skip
        assert expected in names
    # (without the extension dpfast.ops.gather is dpfast.reference.gather itself: one object, listed once)
    assert "dpfast.reference.gather" in names or dpfast.ops.gather is dpfast.reference.gather
    methods = {n for n, _ in FUNCTIONS}
    assert {"dpfast.DataParallel.forward", "dpfast.DataParallel.plan", "dpfast.DataParallel.scatter"} <= methods
    assert "dpfast.DistributedDataParallel.forward" in methods


# read before any test runs: tests/conftest.py wraps DataParallel.forward during each test
HELP_FORWARD = inspect.getdoc(dpfast.DataParallel.forward)


def test_help_of_dataparallel_forward_is_dpfasts():
    """``help(dpfast.DataParallel.forward)`` showed torch's generic ``Module.forward`` text."""
    import torch

    assert inspect.getdoc(torch.nn.Module.forward) != HELP_FORWARD
    assert "in_dims" in HELP_FORWARD and "out_dims" in HELP_FORWARD
