"""The public API's docstrings, as ``help()`` and the docs site (mkdocstrings, Google style) show them: every function
and method here has its own docstring (not torch's, inherited) with ``Args:`` naming exactly its parameters,
``Returns:`` and ``Raises:``; every class documents its constructor's parameters under ``Args:``.

Covers dpfast.ops, dpfast.reference, dpfast.nn, build_info and DataParallel.forward.
"""

from __future__ import annotations

import inspect
import re

import pytest

import dpfast
from dpfast import nn as dpnn
from dpfast import ops, reference

OPS = ["transpose01", "state_to_batch_first", "state_to_layer_first", "split_contiguous", "scatter", "gather"]

FUNCTIONS = (
    [(f"dpfast.ops.{n}", getattr(ops, n)) for n in OPS]
    + [(f"dpfast.reference.{n}", getattr(reference, n)) for n in OPS]
    + [
        ("dpfast.nn.convert_sync_batchnorm", dpnn.convert_sync_batchnorm),
        ("dpfast.nn.SyncBatchNorm.convert_sync_batchnorm", dpnn.SyncBatchNorm.convert_sync_batchnorm),
        ("dpfast.build_info", dpfast.build_info),
    ]
    # methods: the class's own (``vars``), so an inherited torch docstring does not count
    + [(f"dpfast.nn.{c}.forward", vars(getattr(dpnn, c))["forward"]) for c in ("LSTM", "GRU", "RNN", "SyncBatchNorm")]
    + [("dpfast.DataParallel.forward", vars(dpfast.DataParallel)["forward"])]
)
CLASSES = [(f"dpfast.nn.{c}", getattr(dpnn, c)) for c in ("LSTM", "GRU", "RNN", "SyncBatchNorm")]

SECTION = re.compile(r"^(?P<indent> *)(?P<name>Args|Returns|Raises|Yields|Examples?|Notes?):\s*$", re.M)


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


@pytest.mark.parametrize("name,fn", FUNCTIONS, ids=[n for n, _ in FUNCTIONS])
def test_functions_document_args_returns_raises(name, fn):
    sections = _sections(_doc(fn))
    method = name.endswith(".forward") or "SyncBatchNorm.convert" in name
    params = _parameters(fn.__func__ if isinstance(fn, classmethod) else fn, skip_first=method)
    if params:
        assert "Args" in sections, f"{name}: no Args: section"
        assert _documented_args(sections["Args"]) == params, f"{name}: Args: must list {params}, in order"
    assert "Returns" in sections, f"{name}: no Returns: section"
    assert "Raises" in sections, f"{name}: no Raises: section (say what it raises, and when)"
    assert sections["Raises"].strip(), f"{name}: empty Raises: section"


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_classes_document_their_constructor(name, cls):
    """Every constructor parameter, in order. (A constructor that is torch's may take parameters that older torch
    releases lack, such as BatchNorm's ``bias``: the docstring may name those too.)"""
    sections = _sections(_doc(cls))
    assert "Args" in sections, f"{name}: no Args: section for the constructor"
    params = _parameters(cls.__init__, skip_first=True)
    documented = [a for a in _documented_args(sections["Args"]) if a in params]
    assert documented == params, f"{name}: Args: must list {params}, in order"


# read before any test runs: tests/conftest.py wraps DataParallel.forward during each test
HELP_FORWARD = inspect.getdoc(dpfast.DataParallel.forward)


def test_help_of_dataparallel_forward_is_dpfasts():
    """``help(dpfast.DataParallel.forward)`` showed torch's generic ``Module.forward`` text."""
    import torch

    assert inspect.getdoc(torch.nn.Module.forward) != HELP_FORWARD
    assert "in_dims" in HELP_FORWARD and "out_dims" in HELP_FORWARD
