"""``in_dims`` / ``out_dims`` specs: what they are, how they are validated, and the :class:`Leaf` record a walk
(:mod:`dpfast.trees.walk`) makes of each leaf with the spec that applies to it.

A *spec* is a pytree prefix of the value it describes: a leaf spec (``int``, ``None``, and for outputs ``"sum"`` /
``"mean"``) applies to every leaf below it; a tuple/list/dict spec mirrors the value's structure one level down.
A dict spec matches a mapping by key, a namedtuple/dataclass by field name, a torch pytree node by its children's
keys or a KV cache by attribute (naming a subset; the rest use ``dim``); an instance of a dataclass matches a value
of that same dataclass, every field holding that field's spec. ``"items"`` (in and out) takes the list or tuple
under it as a whole: a sequence of per-sample items, split and concatenated by position.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from .containers import is_dataclass_instance, key_text

Spec = Any  # int | None | str | tuple | list | dict | dataclass instance, nested
REDUCTIONS = ("sum", "mean")
ITEMS = "items"  # a sequence of per-sample items


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_leaf_spec(spec: Spec) -> bool:
    return spec is None or is_int(spec) or isinstance(spec, str)


def path_text(where: Any) -> str:
    """A path held as links ``(parent, kind, key)`` down from a root string, as text (``h[0]``, ``batch['x'].y``).
    Walks keep links, not strings: a path's text costs nothing until an error or a plan prints it, and a deep tree
    costs memory linear in its depth."""
    parts = []
    while type(where) is tuple:
        where, kind, key = where
        parts.append(key_text(kind, key))
    parts.append(where)
    return "".join(reversed(parts))


# ---- validating a spec (at construction: types only; structure is checked against each call's values) -----------


def validate_spec(spec: Spec, where: str, allow_reductions: bool) -> None:
    """Raise TypeError/ValueError if ``spec`` holds anything but ints, None, containers (and reductions)."""
    stack: list[tuple[Any, Any]] = [(spec, where)]
    active: set[int] = set()  # containers being checked: a spec that contains itself is refused
    while stack:
        s, w = stack.pop()
        if s is _DONE:
            active.discard(w)
        elif not (s is None or is_int(s)):
            if isinstance(s, str):
                _check_string_spec(s, path_text(w), allow_reductions)
                continue
            children = _spec_children(s, w, allow_reductions)
            if id(s) in active:
                raise ValueError(f"{path_text(w)} contains itself; a spec is a finite tree of ints, None and strings")
            active.add(id(s))
            stack.append((_DONE, id(s)))
            stack.extend(reversed(children))


_DONE = object()


def _check_string_spec(spec: str, where: str, allow_reductions: bool) -> None:
    if spec == ITEMS or (allow_reductions and spec in REDUCTIONS):
        return
    if allow_reductions:
        raise ValueError(
            f"{where} is {spec!r}, which is not a known reduction; use an int (concatenate along that axis), "
            "None (replica 0's value), 'sum', 'mean' or 'items' (concatenate sequences of per-sample items)"
        )
    raise TypeError(
        f"{where} is the string {spec!r}; an in_dims spec is an int (the batch axis), None (replicate), 'items' "
        "(a list/tuple of per-sample items) or a tuple/list/dict of specs ('sum'/'mean' are only for out_dims)"
    )


def _spec_children(spec: Spec, where: Any, allow_reductions: bool) -> list[tuple[Any, Any]]:
    if isinstance(spec, (tuple, list)):
        return [(s, (where, "list", i)) for i, s in enumerate(spec)]
    if isinstance(spec, dict):
        return [(s, (where, "dict", k)) for k, s in spec.items()]
    if is_dataclass_instance(spec):  # an instance of the value's dataclass holding a spec in every field
        return [(getattr(spec, f.name, None), (where, "dataclass", f.name)) for f in dataclasses.fields(spec)]
    allowed = "an int, None, 'items', 'sum', 'mean'" if allow_reductions else "an int, None, 'items'"
    hint = " (not a Python int: give int(...))" if isinstance(spec, numbers.Integral) else ""
    raise TypeError(
        f"{path_text(where)} is {type(spec).__name__} {spec!r}"[:300] + f"{hint}; a spec is {allowed}, or a "
        "tuple/list/dict (or dataclass instance) of specs mirroring the value"
    )


# ---- the one record per leaf ---------------------------------------------------------------------------------------


class Leaf:
    """One leaf of a walked value: where it is, its value, the spec that applies to it; for a call's arguments the
    argument it belongs to and its position, and, once planned (:mod:`dpfast.plan.call_plan`), how it is split;
    for outputs the other replicas' values at the same place."""

    __slots__ = ("_where", "value", "spec", "explicit", "arg", "index", "split", "axis", "size", "problem")

    def __init__(self, where: Any, value: Any, spec: Spec, explicit: bool, arg: int, index: int):
        self._where = where  # the path, as text or as links (see path_text)
        self.value = value
        self.spec = spec  # int | None | "items" | "sum" | "mean"
        self.explicit = explicit  # the user named this argument (or a part of it) in in_dims/out_dims
        self.arg = arg  # the top-level argument it belongs to (-1 outside a call's arguments)
        self.index = index  # its position among the walk's leaves
        # set by planning for a leaf under an int spec or "items": None (not split: copied or passed by
        # reference) | "tensor" (along `axis`) | "quantized" | "jagged" | "packed" (by sequence) | "items"
        self.split: str | None = None
        self.axis: int | None = None  # the batch axis, counted from the front
        self.size: int | None = None  # its size there: this leaf's batch size
        self.problem: str | None = None  # why it has no batch axis (0-dim, axis out of range)

    @property
    def path(self) -> str:
        where = self._where
        if type(where) is not str:
            where = self._where = path_text(where)
        return where

    @property
    def is_packed(self) -> bool:
        return self.split == "packed"

    @property
    def is_items(self) -> bool:
        return self.split == "items"

    def __repr__(self) -> str:
        return f"Leaf({self.path}, spec={self.spec!r}, split={self.split!r})"
