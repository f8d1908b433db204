"""Flatten a value into its leaves and a :class:`~dpfast.trees.containers.TreeDef` (through the one walk of
:mod:`dpfast.trees.specs`), and put new leaves back (:func:`unflatten`); folds over a TreeDef, all without recursion.
A container whose children all come back unchanged is returned as itself.

A :class:`Skeleton` keeps a walked value's structure (no values) so that a value of the same structure, the next
call's, is flattened again without walking specs: the per-leaf work that remains is one type check.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable

from torch import Tensor

from .containers import ATOMS, LEAF, TreeDef, is_cache, node_kind, rebuild
from .specs import Leaf, match_spec, only_atoms, path_text


def flatten(obj: Any, whole_atoms: bool = False) -> tuple[list, TreeDef]:
    """``(leaves, treedef)`` of ``obj``: every tensor, ``None``, ``PackedSequence`` and opaque object in order
    (``whole_atoms``: a list, tuple or dict of plain numbers and strings only is one leaf)."""
    leaves: list[Leaf] = []
    tdef = match_spec(obj, None, "value", None, False, "flatten", leaves, whole_atoms=whole_atoms)
    return [leaf.value for leaf in leaves], tdef


def unflatten(tdef: TreeDef, leaves: Iterable) -> Any:
    return unflatten_from(tdef, iter(leaves))


def unflatten_from(tdef: TreeDef, it: Iterator, own_caches: bool = False) -> Any:
    """:func:`unflatten` taking the leaves from an iterator (several trees can share one).

    ``own_caches``: every KV cache (and everything inside it) is a new object even when its tensors are unchanged,
    for a replica's arguments: a model updates its cache in place, so replicas must not share one (an empty cache
    passed to the first decoding step has no tensor at all)."""
    if tdef is LEAF:
        return next(it)
    frames = [(tdef, iter(tdef.children), [], own_caches and _is_cache_node(tdef))]
    while True:
        node, children, values, inside_cache = frames[-1]
        for child in children:
            if child is LEAF:
                values.append(next(it))
                continue
            frames.append((child, iter(child.children), [], inside_cache or (own_caches and _is_cache_node(child))))
            break
        else:
            frames.pop()
            if not inside_cache and node.orig is not None and all(a is b for a, b in zip(values, node.orig_values)):
                result = node.orig
            else:
                result = rebuild(node, values)
            if not frames:
                return result
            frames[-1][2].append(result)


def _is_cache_node(tdef: TreeDef) -> bool:
    # a cache registered with pytree (transformers does so for torch.export) is a replica's own too
    return tdef.kind == "object" or (tdef.kind == "pytree" and is_cache(tdef.orig))


def fold(tdef: TreeDef, leaves: Iterator, combine: Callable[[TreeDef, list], Any]) -> Any:
    """Bottom-up over ``tdef``: each leaf is the next of ``leaves``, each container ``combine(node, children)``."""
    if tdef is LEAF:
        return next(leaves)
    frames = [(tdef, iter(tdef.children), [])]
    while True:
        node, children, values = frames[-1]
        for child in children:
            if child is LEAF:
                values.append(next(leaves))
                continue
            frames.append((child, iter(child.children), []))
            break
        else:
            frames.pop()
            result = combine(node, values)
            if not frames:
                return result
            frames[-1][2].append(result)


def leaf_paths(tdef: TreeDef, path: str) -> list[str]:
    """The path of every leaf of ``tdef``, in order, below the root ``path``."""
    out: list[str] = []
    stack: list[tuple[TreeDef, Any]] = [(tdef, path)]
    while stack:
        node, where = stack.pop()
        if node is LEAF:
            out.append(path_text(where))
        else:
            stack.extend(reversed([(c, (where, node.kind, k)) for k, c in zip(node.keys, node.children)]))
    return out


# ---- walking a value again along a structure walked before ---------------------------------------------------------

_PLAIN = {"tuple": tuple, "list": list, "dict": dict}
MAX_DEPTH = 64  # a skeleton is read recursively: deeper structures are walked in full every time
# the dict keys a skeleton keeps, compared by value: types whose == is a bool and agrees with their hash
_VALUE_KEYS = frozenset({str, int, bytes, float, complex, bool, type(None)})


class Whole:
    """A skeleton's leaf that was a container of plain numbers and strings taken whole (see ``whole_atoms``)."""

    __slots__ = ("type", "kind")

    def __init__(self, typ: type, kind: str):
        self.type, self.kind = typ, kind


class Skeleton:
    """The structure of a walked value without its values (a kept skeleton holds no tensor): plain containers (exact
    tuples, lists and dicts) and per leaf what it held: ``Tensor`` (a plain tensor), ``type(None)``, the type of an
    atom (an int, a str...) or a :class:`Whole` container of atoms. :meth:`read` walks a value of this very
    structure again into a fresh TreeDef and its leaves, matching no spec; a value that differs anywhere (a
    container's type, length or keys; a leaf's kind) reads as None, and the caller walks it in full."""

    __slots__ = ("kind", "type", "keys", "children", "tensors_only")

    def __init__(self, kind: str, keys: tuple, children: list):
        self.kind, self.type, self.keys, self.children = kind, _PLAIN[kind], keys, children
        self.tensors_only = all(c is Tensor for c in children)

    def read(self, value: Any, leaves: list) -> TreeDef | None:
        """``value``'s TreeDef, its leaves appended to ``leaves``; None (with ``leaves`` partly filled) when
        ``value`` does not have this structure."""
        if type(value) is not self.type:
            return None
        if self.kind == "dict":
            keys = tuple(value)
            if not _same_keys(keys, self.keys):
                return None
            values = tuple(value.values())
        elif len(value) == len(self.keys):
            keys, values = self.keys, tuple(value)
        else:
            return None
        tdef = TreeDef(self.kind, self.type, keys, value, values)
        if self.tensors_only:  # a list of tensors: one check per leaf, and no frame
            if not all(type(v) is Tensor for v in values):
                return None
            leaves.extend(values)
            tdef.children = [LEAF] * len(values)
            return tdef
        return tdef if read_along(self.children, values, leaves, tdef.children) else None


def read_along(codes: Sequence[Any], values: Sequence[Any], leaves: list, defs: list) -> bool:
    """Read ``values`` along their skeleton codes (a :class:`Skeleton` or a leaf's code each): each one's TreeDef
    appended to ``defs`` and its leaves to ``leaves``; False at the first value of another structure."""
    for code, v in zip(codes, values):
        if type(code) is Skeleton:
            child = code.read(v, leaves)
            if child is None:
                return False
            defs.append(child)
        elif is_leaf(code, v):
            leaves.append(v)
            defs.append(LEAF)
        else:
            return False
    return True


def is_leaf(code: Any, value: Any) -> bool:
    """Whether ``value`` is the kind of leaf a skeleton recorded as ``code``."""
    if type(code) is Whole:
        return type(value) is code.type and only_atoms(value, code.kind)
    return type(value) is code


def skeleton_of(tdef: TreeDef, leaves: Sequence[Any]) -> Any:
    """The :class:`Skeleton` (or, for a value that is one leaf, the leaf's code) of a walked value whose leaves'
    values are ``leaves``, or None when it holds anything else than plain containers, tensors, None and atoms, or
    is deeper than :data:`MAX_DEPTH`."""
    codes = [_code(v) for v in leaves]
    if None in codes or _depth(tdef) > MAX_DEPTH:
        return None

    def combine(node: TreeDef, children: list) -> Any:
        if None in children or _PLAIN.get(node.kind) is not node.meta:
            return None
        if node.kind == "dict" and not all(type(k) in _VALUE_KEYS for k in node.keys):
            return None  # a key of another kind is the same key only as the same object: kept, it would stay alive
        return Skeleton(node.kind, node.keys, children)

    return fold(tdef, iter(codes), combine)


def _code(v: Any) -> Any:
    t = type(v)
    if t is Tensor or v is None or t in ATOMS:
        return t
    kind = node_kind(v)  # a leaf of any other kind is a container of atoms taken whole, or not for a skeleton
    return Whole(t, kind) if kind in ("list", "tuple", "dict") and only_atoms(v, kind) else None


def _depth(tdef: TreeDef) -> int:
    deepest, stack = 0, [(tdef, 0)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in node.children if c is not LEAF)
    return deepest


def _same_keys(a: tuple, b: tuple) -> bool:
    """The same keys in the same order, each of the same type (``1`` and ``True`` are equal, but not the same key
    in a path). A skeleton keeps only builtin atoms as keys (:func:`skeleton_of`): an equal tensor or an object
    hashed by identity is another key to a dict, and a tensor's ``==`` is no bool, so ``b``'s keys of any other
    type differ from every kept key."""
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and type(x) in _VALUE_KEYS and x == y) for x, y in zip(a, b)
    )
