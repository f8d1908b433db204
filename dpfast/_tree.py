"""Argument and output trees: flatten a value into its leaves and a :class:`TreeDef`, and put new leaves back.

The walker is our own and deliberately small: tensors, ``None``, tuples, lists, dicts, namedtuples and dataclass
instances are walked; ``PackedSequence`` is a leaf (it is split by sequence as a whole, see
:mod:`dpfast._transfer`); everything else is an opaque leaf passed by reference. A container whose children all
come back unchanged is returned as itself.

Paths name a leaf the way you would write it in Python: ``x``, ``h[0]``, ``batch['mask']``, ``state.h``
(namedtuple or dataclass field).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.nn.utils.rnn import PackedSequence


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


class TreeDef:
    """The structure of a value with its leaves taken out; ``unflatten`` puts new leaves back."""

    __slots__ = ("kind", "meta", "keys", "children", "orig", "orig_values")

    def __init__(
        self,
        kind: str,
        meta: Any = None,
        keys: tuple = (),
        children: tuple = (),
        orig: Any = None,
        orig_values: tuple = (),
    ):
        self.kind = kind  # "leaf" | "tuple" | "list" | "dict" | "namedtuple" | "dataclass"
        self.meta = meta  # the container's type (dataclass: the original instance, for dataclasses.replace)
        self.keys = keys  # indices, dict keys or field names, in child order
        self.children = children
        # The flattened container and its children: a container whose children all come back unchanged is
        # returned as itself, so tensor-free structures (a list of lengths) reach every replica by reference.
        self.orig = orig
        self.orig_values = orig_values

    def same_structure(self, other: TreeDef) -> bool:
        if self.kind != other.kind or self.keys != other.keys or len(self.children) != len(other.children):
            return False
        if self.kind != "leaf" and self.kind != "dataclass" and self.meta is not other.meta:
            return False
        if self.kind == "dataclass" and type(self.meta) is not type(other.meta):
            return False
        return all(a.same_structure(b) for a, b in zip(self.children, other.children))

    def describe(self) -> str:
        if self.kind == "leaf":
            return "a leaf"
        if self.kind in ("tuple", "list"):
            return f"a {self.meta.__name__} of length {len(self.keys)}"
        if self.kind == "dict":
            return f"a dict with keys {list(self.keys)!r}"
        return (
            f"a {self.meta.__name__ if self.kind == 'namedtuple' else type(self.meta).__name__} "
            f"with fields {list(self.keys)!r}"
        )


LEAF = TreeDef("leaf")


def node_kind(obj: Any) -> str | None:
    """The container kind of ``obj``, or ``None`` for a leaf."""
    if isinstance(obj, Tensor) or obj is None:
        return None
    if isinstance(obj, PackedSequence):  # a namedtuple subclass, but one batch as a whole: a leaf
        return None
    if isinstance(obj, tuple):
        return "namedtuple" if is_namedtuple(obj) else "tuple"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, dict):
        return "dict"
    if is_dataclass_instance(obj):
        return "dataclass"
    return None


def children_of(obj: Any, kind: str) -> tuple[tuple, tuple]:
    """``(keys, values)`` of a container."""
    if kind in ("tuple", "list"):
        return tuple(range(len(obj))), tuple(obj)
    if kind == "namedtuple":
        return tuple(type(obj)._fields), tuple(obj)
    if kind == "dict":
        return tuple(obj.keys()), tuple(obj.values())
    fields = tuple(f.name for f in dataclasses.fields(obj))
    return fields, tuple(getattr(obj, f) for f in fields)


def flatten(obj: Any) -> tuple[list, TreeDef]:
    leaves: list = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list) -> TreeDef:
    kind = node_kind(obj)
    if kind is None:
        leaves.append(obj)
        return LEAF
    keys, values = children_of(obj, kind)
    meta = obj if kind == "dataclass" else type(obj)
    return TreeDef(kind, meta, keys, tuple(_flatten(v, leaves) for v in values), obj, values)


def unflatten(tdef: TreeDef, leaves: Iterable) -> Any:
    return unflatten_from(tdef, iter(leaves))


def unflatten_from(tdef: TreeDef, it) -> Any:
    """:func:`unflatten` taking the leaves from an iterator (several trees can share one)."""
    if tdef.kind == "leaf":
        return next(it)
    values = [unflatten_from(c, it) for c in tdef.children]
    if tdef.orig is not None and all(a is b for a, b in zip(values, tdef.orig_values)):
        return tdef.orig
    return rebuild(tdef, values)


def rebuild(tdef: TreeDef, values: list) -> Any:
    kind, meta = tdef.kind, tdef.meta
    if kind == "tuple":
        return tuple(values) if meta is tuple else meta(values)
    if kind == "list":
        return values if meta is list else meta(values)
    if kind == "namedtuple":
        return meta(*values)
    if kind == "dict":
        if meta is dict:
            return dict(zip(tdef.keys, values))
        if tdef.orig is not None:
            # a shallow copy keeps the subclass and its attributes (a defaultdict's default_factory, an
            # OrderedDict's order), then the new values replace the old ones
            try:
                out = copy.copy(tdef.orig)
                out.clear()
                out.update(zip(tdef.keys, values))
                if type(out) is meta and list(out.keys()) == list(tdef.keys):
                    return out
            except Exception:
                pass
        try:
            return meta(zip(tdef.keys, values))
        except Exception:  # dict subclasses with their own constructor: a plain dict is safer
            return dict(zip(tdef.keys, values))
    # dataclass: replace init fields, set the others (works for frozen dataclasses too)
    fields = dataclasses.fields(meta)
    init = {f.name: v for f, v in zip(fields, values) if f.init}
    out = dataclasses.replace(meta, **init)
    for f, v in zip(fields, values):
        if not f.init:
            object.__setattr__(out, f.name, v)
    return out


def child_path(path: str, kind: str, key: Any) -> str:
    if kind in ("namedtuple", "dataclass"):
        return f"{path}.{key}"
    return f"{path}[{key!r}]"


def leaf_paths(tdef: TreeDef, path: str) -> list[str]:
    out: list[str] = []
    _leaf_paths(tdef, path, out)
    return out


def _leaf_paths(tdef: TreeDef, path: str, out: list[str]) -> None:
    if tdef.kind == "leaf":
        out.append(path)
        return
    for k, c in zip(tdef.keys, tdef.children):
        _leaf_paths(c, child_path(path, tdef.kind, k), out)


def packed_batch(ps: PackedSequence) -> int:
    """The number of sequences in a PackedSequence (its batch size)."""
    return int(ps.batch_sizes[0]) if ps.batch_sizes.numel() else 0


def describe_value(obj: Any) -> str:
    if isinstance(obj, Tensor):
        return f"a Tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, PackedSequence):
        return "a PackedSequence"
    kind = node_kind(obj)
    if kind is None:
        return "None" if obj is None else f"a {type(obj).__name__}"
    keys, _ = children_of(obj, kind)
    if kind in ("tuple", "list"):
        return f"a {type(obj).__name__} of length {len(keys)}"
    if kind == "dict":
        return f"a dict with keys {list(keys)!r}"
    return f"a {type(obj).__name__} with fields {list(keys)!r}"


# ---------------------------------------------------------------------------------------------------------------
# Spec validation (at construction: types only; structure is checked against each call's values)
