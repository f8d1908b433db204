"""Argument and output trees: flatten a value into its leaves and a :class:`TreeDef`, and put new leaves back.

The walker is our own and deliberately small. Containers: tuples, lists, namedtuples, dataclass instances (also
those that are mappings too, like HF's ``ModelOutput``: by their fields, ``None`` ones included), every
``collections.abc.Mapping`` (``dict`` and its subclasses, ``UserDict``, HF's ``BatchEncoding``), types registered
with ``torch.utils._pytree``, and transformers' KV caches (:mod:`dpfast.trees.library_types`). Tensors, ``None`` and
``PackedSequence`` (split by sequence as a whole, see :mod:`dpfast.move.scatter`) are leaves; everything else is an
opaque leaf passed by reference. A container whose children all come back unchanged is returned as itself.

Paths name a leaf the way you would write it in Python: ``x``, ``h[0]``, ``batch['mask']``, ``state.h``
(namedtuple or dataclass field, or an attribute), ``cache.layers[0].keys``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from .library_types import (
    cache_children,
    cache_rebuild,
    is_cache,
    key_name,
    pytree_children,
    pytree_node,
    pytree_rebuild,
)


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
        # "leaf" | "tuple" | "list" | "dict" (any Mapping) | "namedtuple" | "dataclass" | "pytree" (registered with
        # torch.utils._pytree) | "object" (a transformers KV cache, by its attributes)
        self.kind = kind
        # the container's type (dataclass: the original instance, for dataclasses.replace; pytree: a PytreeMeta)
        self.meta = meta
        self.keys = keys  # indices, dict keys, field or attribute names, pytree key entries, in child order
        self.children = children
        # The flattened container and its children: a container whose children all come back unchanged is
        # returned as itself, so tensor-free structures (a list of lengths) reach every replica by reference.
        self.orig = orig
        self.orig_values = orig_values

    def same_structure(self, other: TreeDef) -> bool:
        if self.kind != other.kind or self.keys != other.keys or len(self.children) != len(other.children):
            return False
        if self.kind != "leaf" and _type_of(self) is not _type_of(other):
            return False
        return all(a.same_structure(b) for a, b in zip(self.children, other.children))

    def describe(self) -> str:
        if self.kind == "leaf":
            return "a leaf"
        return _describe(self.kind, _type_of(self), self.keys)


def _type_of(tdef: TreeDef) -> type:
    if tdef.kind == "dataclass":
        return type(tdef.meta)
    if tdef.kind == "pytree":
        return tdef.meta.type
    return tdef.meta


def _describe(kind: str, typ: type, keys: tuple) -> str:
    if kind in ("tuple", "list"):
        return f"a {typ.__name__} of length {len(keys)}"
    if kind == "dict":
        return f"a {'dict' if issubclass(typ, dict) else typ.__name__} with keys {list(keys)!r}"
    if kind == "pytree":
        return f"a {typ.__name__} (a torch pytree node) with children {[key_name(k) for k in keys]!r}"
    if kind == "object":
        return f"a {typ.__name__} with attributes {list(keys)!r}"
    return f"a {typ.__name__} with fields {list(keys)!r}"


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
    if is_dataclass_instance(obj):  # before Mapping: a dataclass dict hybrid (ModelOutput) goes by its fields
        return "dataclass"
    if isinstance(obj, Mapping):
        return "dict"
    if pytree_node(obj) is not None:
        return "pytree"
    if is_cache(obj):
        return "object"
    return None


def node_parts(obj: Any, kind: str) -> tuple[Any, tuple, tuple]:
    """``(meta, keys, values)`` of a container: what its TreeDef records, and its children."""
    if kind in ("tuple", "list"):
        return type(obj), tuple(range(len(obj))), tuple(obj)
    if kind == "namedtuple":
        return type(obj), tuple(type(obj)._fields), tuple(obj)
    if kind == "dict":
        return type(obj), tuple(obj.keys()), tuple(obj.values())
    if kind == "pytree":
        keys, values, meta = pytree_children(obj)
        return meta, keys, values
    if kind == "object":
        keys, values = cache_children(obj)
        return type(obj), keys, values
    fields = tuple(f.name for f in dataclasses.fields(obj))
    return obj, fields, tuple(getattr(obj, f) for f in fields)


def children_of(obj: Any, kind: str) -> tuple[tuple, tuple]:
    """``(keys, values)`` of a container."""
    _, keys, values = node_parts(obj, kind)
    return keys, values


def key_names(kind: str, keys: tuple) -> list:
    """The names a dict spec uses for a container's children (pytree key entries by their key or name)."""
    return [key_name(k) for k in keys] if kind == "pytree" else list(keys)


def flatten(obj: Any) -> tuple[list, TreeDef]:
    leaves: list = []
    return leaves, _flatten(obj, leaves)


def _flatten(obj: Any, leaves: list) -> TreeDef:
    kind = node_kind(obj)
    if kind is None:
        leaves.append(obj)
        return LEAF
    meta, keys, values = node_parts(obj, kind)
    return TreeDef(kind, meta, keys, tuple(_flatten(v, leaves) for v in values), obj, values)


def flatten_like(obj: Any, tdef: TreeDef) -> list | None:
    """The values of ``obj`` at the leaves of ``tdef`` (whose leaves may be containers: a sequence under
    ``"items"``), or None when ``obj`` does not have ``tdef``'s structure."""
    out: list = []
    return out if _flatten_like(obj, tdef, out) else None


def _flatten_like(obj: Any, tdef: TreeDef, out: list) -> bool:
    if tdef.kind == "leaf":
        out.append(obj)
        return True
    kind = node_kind(obj)
    if kind != tdef.kind:
        return False
    meta, keys, values = node_parts(obj, kind)
    node = TreeDef(kind, meta, keys)
    if keys != tdef.keys or _type_of(node) is not _type_of(tdef):
        return False
    return all(_flatten_like(v, c, out) for v, c in zip(values, tdef.children))


def unflatten(tdef: TreeDef, leaves: Iterable) -> Any:
    return unflatten_from(tdef, iter(leaves))


def unflatten_from(tdef: TreeDef, it, own_caches: bool = False) -> Any:
    """:func:`unflatten` taking the leaves from an iterator (several trees can share one).

    ``own_caches``: every KV cache (and everything inside it) is a new object even when its tensors are unchanged,
    for a replica's arguments: a model updates its cache in place, so replicas must not share one (an empty cache
    passed to the first decoding step has no tensor at all)."""
    return _unflatten(tdef, it, own_caches, False)


def _unflatten(tdef: TreeDef, it, own_caches: bool, inside_cache: bool) -> Any:
    if tdef.kind == "leaf":
        return next(it)
    # a cache registered with pytree (transformers does so for torch.export) is a replica's own too
    inside_cache = inside_cache or (
        own_caches and (tdef.kind == "object" or (tdef.kind == "pytree" and is_cache(tdef.orig)))
    )
    values = [_unflatten(c, it, own_caches, inside_cache) for c in tdef.children]
    if not inside_cache and tdef.orig is not None and all(a is b for a, b in zip(values, tdef.orig_values)):
        return tdef.orig
    return rebuild(tdef, values)


def rebuild(tdef: TreeDef, values: list) -> Any:
    kind, meta = tdef.kind, tdef.meta
    if kind == "pytree":
        return pytree_rebuild(meta, values)
    if kind == "object":
        return cache_rebuild(tdef.orig, tdef.keys, values)
    if kind == "tuple":
        return tuple(values) if meta is tuple else meta(values)
    if kind == "list":
        return values if meta is list else meta(values)
    if kind == "namedtuple":
        return meta(*values)
    if kind == "dict":
        if meta is dict:
            return dict(zip(tdef.keys, values))
        if tdef.orig is not None and issubclass(meta, (dict, UserDict)):
            # a shallow copy keeps the type and its attributes (a defaultdict's default_factory, an OrderedDict's
            # order, a BatchEncoding's encodings), then the new values replace the old ones. Only for types whose
            # copy has storage of its own: clearing the copy of another mapping could clear the caller's.
            try:
                out = copy.copy(tdef.orig)
                out.clear()
                out.update(zip(tdef.keys, values))
                if type(out) is meta and list(out.keys()) == list(tdef.keys):
                    return out
            except Exception:
                pass
        for make in (lambda: meta(zip(tdef.keys, values)), lambda: meta(dict(zip(tdef.keys, values)))):
            try:  # read-only mappings take their items in the constructor
                out = make()
                if type(out) is meta and list(out.keys()) == list(tdef.keys):
                    return out
            except Exception:
                pass
        return dict(zip(tdef.keys, values))  # a mapping we cannot rebuild: a plain dict is safer
    # dataclass: replace init fields, set the others (works for frozen dataclasses too)
    fields = dataclasses.fields(meta)
    init = {f.name: v for f, v in zip(fields, values) if f.init}
    out = dataclasses.replace(meta, **init)
    for f, v in zip(fields, values):
        if not f.init:
            object.__setattr__(out, f.name, v)
    return out


def child_path(path: str, kind: str, key: Any) -> str:
    if kind in ("namedtuple", "dataclass", "object"):
        return f"{path}.{key}"
    if kind == "pytree" and not isinstance(key, (int, str)):
        return f"{path}{key}"  # a pytree key entry prints as `.name`, `['key']` or `[0]`
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
        if obj.is_nested and obj.layout != torch.jagged:
            return f"a nested tensor with layout {obj.layout}"
        return f"a Tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, PackedSequence):
        return "a PackedSequence"
    kind = node_kind(obj)
    if kind is None:
        return "None" if obj is None else f"a {type(obj).__name__}"
    keys, _ = children_of(obj, kind)
    return _describe(kind, type(obj), keys)


# ---------------------------------------------------------------------------------------------------------------
# Spec validation (at construction: types only; structure is checked against each call's values)
