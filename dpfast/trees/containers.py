"""What a container is, for dpfast's walks (:mod:`dpfast.trees.specs`): its kind, its children, its structure
(:class:`TreeDef`), and how to build it again around new children.

Containers: tuples, lists, namedtuples, dataclass instances (also those that are mappings too, like HF's
``ModelOutput``: by their fields, ``None`` ones included), every ``collections.abc.Mapping`` (``dict`` and its
subclasses, ``UserDict``, HF's ``BatchEncoding``), types registered with ``torch.utils._pytree``, and transformers'
KV caches (:mod:`dpfast.trees.library_types`). Tensors, ``None`` and ``PackedSequence`` (split by sequence as a
whole, see :mod:`dpfast.move.scatter`) are leaves; everything else is an opaque leaf passed by reference.

Paths name a leaf the way you would write it in Python: ``x``, ``h[0]``, ``batch['mask']``, ``state.h``
(namedtuple or dataclass field, or an attribute), ``cache.layers[0].keys``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import UserDict
from collections.abc import Mapping
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
    """A namedtuple, recognised as ``torch.utils._pytree`` does (``_fields`` of strings, ``_make`` and ``_asdict``),
    and only when its fields name every element: a tuple subclass that merely has a ``_fields`` attribute is a
    tuple (rebuilding it by field would drop or invent elements)."""
    if not isinstance(obj, tuple):
        return False
    cls = type(obj)
    fields = getattr(cls, "_fields", None)
    return (
        isinstance(fields, tuple)
        and len(fields) == len(obj)
        and all(type(f) is str for f in fields)
        and callable(getattr(cls, "_make", None))
        and callable(getattr(cls, "_asdict", None))
    )


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


class TreeDef:
    """The structure of a value with its leaves taken out (:func:`dpfast.trees.flatten.unflatten` puts new leaves
    back). Every leaf is :data:`LEAF`."""

    __slots__ = ("kind", "meta", "keys", "children", "orig", "orig_values")

    def __init__(self, kind: str, meta: Any = None, keys: tuple = (), orig: Any = None, orig_values: tuple = ()):
        # "leaf" | "tuple" | "list" | "dict" (any Mapping) | "namedtuple" | "dataclass" | "pytree" (registered with
        # torch.utils._pytree) | "object" (a transformers KV cache, by its attributes)
        self.kind = kind
        # the container's type (dataclass: the original instance, for dataclasses.replace; pytree: a PytreeMeta)
        self.meta = meta
        self.keys = keys  # indices, dict keys, field or attribute names, pytree key entries, in child order
        self.children: list[TreeDef] = []  # filled in by the walk, in order
        # The walked container and its children: a container whose children all come back unchanged is returned
        # as itself, so tensor-free structures (a list of lengths) reach every replica by reference.
        self.orig = orig
        self.orig_values = orig_values


LEAF = TreeDef("leaf")

# Containers whose children are all of these exact types hold no tensor: an argument's walk takes them whole
# (a list of 10**7 token ids is one leaf, passed by reference, not 10**7 of them).
ATOMS = frozenset({int, float, bool, complex, str, bytes})


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


class TooManyChildren(Exception):
    """Raised by :func:`node_parts` when a container holds more than ``limit`` children (the walk words it)."""


class InconsistentMapping(Exception):
    """A Mapping whose iteration gives more items than its ``len()`` (one whose iteration never ends, say)."""


_UNSET = object()


def node_parts(obj: Any, kind: str, limit: int) -> tuple[Any, tuple, tuple]:
    """``(meta, keys, values)`` of a container: what its TreeDef records, and its children. Reads at most
    ``limit`` children (raising :class:`TooManyChildren` past it), so a Mapping whose iteration never ends stops."""
    if kind in ("tuple", "list"):
        if len(obj) > limit:
            raise TooManyChildren(len(obj))
        return type(obj), tuple(range(len(obj))), tuple(obj)
    if kind == "namedtuple":
        return type(obj), type(obj)._fields, tuple(obj)
    if kind == "dict":
        return type(obj), *_mapping_items(obj, limit)
    if kind == "pytree":
        keys, values, meta = pytree_children(obj)
    elif kind == "object":
        keys, values = cache_children(obj)
        meta = type(obj)
    else:  # a dataclass: by its fields; an init=False field that was never set is not there to walk
        pairs = [(f.name, getattr(obj, f.name, _UNSET)) for f in dataclasses.fields(obj)]
        pairs = [(k, v) for k, v in pairs if v is not _UNSET]
        keys, values, meta = tuple(k for k, _ in pairs), tuple(v for _, v in pairs), obj
    if len(values) > limit:
        raise TooManyChildren(len(values))
    return meta, tuple(keys), tuple(values)


def _mapping_items(obj: Any, limit: int) -> tuple[tuple, tuple]:
    if type(obj) is dict:
        if len(obj) > limit:
            raise TooManyChildren(len(obj))
        return tuple(obj.keys()), tuple(obj.values())
    n = len(obj)
    if n > limit:
        raise TooManyChildren(n)
    items = list(itertools.islice(obj.items(), n + 1))  # one more than len() says: is there an end?
    if len(items) > n:
        raise InconsistentMapping(n)
    return tuple(k for k, _ in items), tuple(v for _, v in items)


def key_names(kind: str, keys: tuple) -> list:
    """The names a dict spec uses for a container's children (pytree key entries by their key or name)."""
    return [key_name(k) for k in keys] if kind == "pytree" else list(keys)


def rebuild(tdef: TreeDef, values: list) -> Any:
    """The container ``tdef`` describes, holding ``values``."""
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
        return _rebuild_mapping(tdef, values)
    # dataclass: replace init fields, set the others (works for frozen dataclasses too)
    init = {f.name for f in dataclasses.fields(meta) if f.init}
    out = dataclasses.replace(meta, **{k: v for k, v in zip(tdef.keys, values) if k in init})
    for k, v in zip(tdef.keys, values):
        if k not in init:
            object.__setattr__(out, k, v)
    return out


def _rebuild_mapping(tdef: TreeDef, values: list) -> Any:
    meta = tdef.meta
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


def child_path(path: str, kind: str, key: Any) -> str:
    return path + key_text(kind, key)


def key_text(kind: str, key: Any) -> str:
    """How a child's key extends its parent's path: ``.name``, ``['key']``, ``[0]``."""
    if kind in ("namedtuple", "dataclass", "object"):
        return f".{key}"
    if kind == "pytree" and not isinstance(key, (int, str)):
        return str(key)  # a pytree key entry prints as `.name`, `['key']` or `[0]`
    return f"[{key!r}]"


def packed_batch(ps: PackedSequence) -> int:
    """The number of sequences in a PackedSequence (its batch size)."""
    return int(ps.batch_sizes[0]) if ps.batch_sizes.numel() else 0


def describe_value(obj: Any) -> str:
    """``obj`` in a few words for an error message (its type and shape, or its keys)."""
    if isinstance(obj, Tensor):
        if obj.is_nested and obj.layout != torch.jagged:
            return f"a nested tensor with layout {obj.layout}"
        return f"a Tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, PackedSequence):
        return "a PackedSequence"
    kind = node_kind(obj)
    typ = type(obj)
    if kind is None:
        return "None" if obj is None else f"a {typ.__name__}"
    if kind in ("tuple", "list"):
        return f"a {typ.__name__} of length {len(obj)}"
    try:
        _, keys, _ = node_parts(obj, kind, 64)
    except Exception:  # noqa: BLE001 - a description must not fail (a huge or broken container)
        return f"a {typ.__name__}"
    if kind == "dict":
        return f"a {'dict' if issubclass(typ, dict) else typ.__name__} with keys {list(keys)!r}"[:300]
    if kind == "pytree":
        return f"a {typ.__name__} (a torch pytree node) with children {[key_name(k) for k in keys]!r}"[:300]
    if kind == "object":
        return f"a {typ.__name__} with attributes {list(keys)!r}"
    return f"a {typ.__name__} with fields {list(keys)!r}"
