"""Flatten a value into its leaves and a :class:`~dpfast.trees.containers.TreeDef` (through the one walk of
:mod:`dpfast.trees.walk`), and put new leaves back (:func:`unflatten`); folds over a TreeDef, all without recursion.
A container whose children all come back unchanged is returned as itself.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Callable

from .containers import LEAF, TreeDef, is_cache, rebuild
from .specs import path_text
from .walk import Walk


def flatten(obj: Any, whole_atoms: bool = False) -> tuple[list, TreeDef]:
    """``(leaves, treedef)`` of ``obj``: every tensor, ``None``, ``PackedSequence`` and opaque object in order
    (``whole_atoms``: a list, tuple or dict of plain numbers and strings only is one leaf)."""
    w = Walk(None, "flatten", whole_atoms=whole_atoms)
    tdef = w.run(obj, None, "value", False)
    return w.values, tdef


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
        if not values and node.children.count(LEAF) == len(node.children):  # a container of leaves: at once
            values.extend(islice(it, len(node.children)))
            children = iter(())
        for child in children:
            if child is LEAF:
                values.append(next(it))
                continue
            frames.append((child, iter(child.children), [], inside_cache or (own_caches and _is_cache_node(child))))
            break
        else:
            frames.pop()
            if not inside_cache and node.orig is not None and all(map(operator.is_, values, node.orig_values)):
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
