"""``in_dims`` / ``out_dims`` specs: validate them, and match a spec prefix to a value's tree.

A *spec* is a pytree prefix of the value it describes: a leaf spec (``int``, ``None``, and for outputs ``"sum"`` /
``"mean"``) applies to every leaf below it; a tuple/list/dict spec mirrors the value's structure one level down.
A dict spec matches a mapping by key, a namedtuple/dataclass by field name, a torch pytree node by its children's
keys or a KV cache by attribute (naming a subset; the rest use ``dim``); an instance of a dataclass matches a value
of that same dataclass, every field holding that field's spec. ``"items"`` (in and out) takes the list or tuple
under it as a whole: a sequence of per-sample items, split and concatenated by position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .flatten import (
    LEAF,
    TreeDef,
    child_path,
    describe_value,
    is_dataclass_instance,
    is_namedtuple,
    key_names,
    node_kind,
    node_parts,
)

Spec = Any  # int | None | str | tuple | list | dict | dataclass instance, nested
REDUCTIONS = ("sum", "mean")
ITEMS = "items"  # a sequence of per-sample items


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_leaf_spec(spec: Spec) -> bool:
    return spec is None or is_int(spec) or isinstance(spec, str)


def validate_spec(spec: Spec, where: str, allow_reductions: bool) -> None:
    """Raise TypeError/ValueError if ``spec`` holds anything but ints, None, containers (and reductions)."""
    if spec is None or is_int(spec):
        return
    if isinstance(spec, str):
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
    if isinstance(spec, (tuple, list)):
        for i, s in enumerate(spec):
            validate_spec(s, f"{where}[{i}]", allow_reductions)
        return
    if isinstance(spec, dict):
        for k, s in spec.items():
            validate_spec(s, f"{where}[{k!r}]", allow_reductions)
        return
    if is_dataclass_instance(spec):  # an instance of the value's dataclass holding a spec in every field
        for f in dataclasses.fields(spec):
            validate_spec(getattr(spec, f.name), f"{where}.{f.name}", allow_reductions)
        return
    allowed = "an int, None, 'items', 'sum', 'mean'" if allow_reductions else "an int, None, 'items'"
    raise TypeError(
        f"{where} is {type(spec).__name__} {spec!r}; a spec is {allowed}, or a tuple/list/dict (or dataclass "
        "instance) of specs mirroring the value"
    )


# ---------------------------------------------------------------------------------------------------------------
# Matching a spec prefix to a value


class SpecLeaf:
    """One leaf of a value with the spec that applies to it."""

    __slots__ = ("path", "value", "spec", "explicit")

    def __init__(self, path: str, value: Any, spec: Spec, explicit: bool):
        self.path = path
        self.value = value
        self.spec = spec  # int | None | "items" | "sum" | "mean"
        self.explicit = explicit  # the user named this argument (or a part of it) in in_dims/out_dims


def match_spec(
    value: Any, spec: Spec, path: str, default: Spec, explicit: bool, what: str, out: list[SpecLeaf]
) -> TreeDef:
    """Flatten ``value``, appending one :class:`SpecLeaf` per leaf to ``out``; returns the TreeDef.

    Dict specs may name a subset of a dict's keys (or a namedtuple's/dataclass's fields); the rest use ``default``
    (the DataParallel's ``dim``), as top-level arguments that ``in_dims`` does not name do.
    """
    kind = node_kind(value)
    if spec == ITEMS:
        if value is not None and (kind not in ("list", "tuple") or is_namedtuple(value)):
            raise TypeError(
                f"{what} for `{path}` is 'items', but `{path}` is {describe_value(value)}; 'items' is for a list or "
                "tuple of per-sample items (for a tensor, give its batch axis as an int)"
            )
        out.append(SpecLeaf(path, value, spec, explicit))
        return LEAF
    if is_leaf_spec(spec):
        if kind is None:
            out.append(SpecLeaf(path, value, spec, explicit))
            return LEAF
        meta, keys, values = node_parts(value, kind)
        return TreeDef(
            kind,
            meta,
            keys,
            tuple(
                match_spec(v, spec, child_path(path, kind, k), default, explicit, what, out)
                for k, v in zip(keys, values)
            ),
            value,
            values,
        )
    # a container spec: the value must be a container of the matching shape
    if is_dataclass_instance(spec):
        # a dataclass instance as the spec of a value of the same dataclass: every field holds that field's spec
        if type(value) is not type(spec):
            raise TypeError(
                f"{what} for `{path}` is a {type(spec).__name__} instance, but `{path}` is {describe_value(value)}; "
                f"a dataclass spec matches a value of the same dataclass (use a dict keyed by field names otherwise)"
            )
        spec = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if isinstance(spec, (tuple, list)):
        if kind not in ("tuple", "list", "namedtuple", "pytree"):
            raise TypeError(
                f"{what} for `{path}` is a {type(spec).__name__} of {len(spec)} specs, but `{path}` is "
                f"{describe_value(value)}; give one int/None for it, or a spec mirroring its structure"
            )
        meta, keys, values = node_parts(value, kind)
        if len(spec) != len(values):
            raise ValueError(
                f"{what} for `{path}` has {len(spec)} specs but `{path}` is {describe_value(value)}; give one spec "
                "per element, or a single int/None for all of them"
            )
        specs = list(spec)
    elif isinstance(spec, dict):
        if kind not in ("dict", "namedtuple", "dataclass", "pytree", "object"):
            raise TypeError(
                f"{what} for `{path}` is a dict with keys {list(spec)!r}, but `{path}` is {describe_value(value)}; "
                "a dict spec matches a mapping (by key) or a namedtuple/dataclass (by field name)"
            )
        meta, keys, values = node_parts(value, kind)
        names = key_names(kind, keys)
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise ValueError(
                f"{what} for `{path}` names {unknown!r}, which `{path}` does not have; it is {describe_value(value)}"
            )
        specs = [spec.get(k, _DEFAULT) for k in names]
    else:  # pragma: no cover - validate_spec rejects everything else at construction
        raise TypeError(f"{what} for `{path}`: unsupported spec {spec!r}")
    children = []
    for k, v, s in zip(keys, values, specs):
        p = child_path(path, kind, k)
        if s is _DEFAULT:
            children.append(match_spec(v, default, p, default, False, what, out))
        else:
            children.append(match_spec(v, s, p, default, True, what, out))
    return TreeDef(kind, meta, keys, tuple(children), value, values)


_DEFAULT = object()


# ---------------------------------------------------------------------------------------------------------------
# Binding in_dims to forward's signature


def spec_tree_repr(tdef: TreeDef, specs: Iterable[Spec]) -> Spec:
    """A spec mirroring ``tdef`` with the given leaf specs (for suggestions); collapses when uniform."""
    it = iter(specs)
    return _spec_tree(tdef, it)


def _spec_tree(tdef: TreeDef, it) -> Spec:
    if tdef.kind == "leaf":
        return next(it)
    children = [_spec_tree(c, it) for c in tdef.children]
    if all(is_leaf_spec(c) for c in children) and len(set(map(repr, children))) == 1:
        return children[0]
    if tdef.kind in ("dict", "dataclass", "object"):
        return dict(zip(tdef.keys, children))
    if tdef.kind == "pytree" and not all(isinstance(k, int) for k in tdef.keys):
        return dict(zip(key_names(tdef.kind, tdef.keys), children))
    return tuple(children)
