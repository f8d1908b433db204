"""The one walk of a value with its spec: its leaves in order, its :class:`~dpfast.trees.containers.TreeDef`, and
its *structure* (by value: with the leaves' facts, :func:`~dpfast.trees.facts.leaf_facts`, the value's key), or one
:class:`~dpfast.trees.specs.Leaf` record per leaf.

Every call walks its arguments (and every replica's outputs) once, for their key; a call program is looked up by
it (:mod:`dpfast.plan.program`). Only a call of a key not seen before is walked again, recording each leaf's path
and spec, to compile its program. Both walks are this code on the same values, so they give the same leaves.

Where the walk stops is decided by the spec and the value together: ``"items"`` takes the sequence under it as one
leaf; a non-empty list, tuple or dict of plain numbers and strings is one leaf under ``None`` or the default spec
(it holds no tensor: a list of 10**7 token ids is one leaf, passed by reference); anything else that is a container
is opened. The walk is iterative (no depth limit but memory), refuses a container that contains itself (naming the
path where the cycle closes), and reads at most :data:`MAX_VALUES` values: past that it refuses the value.
"""

from __future__ import annotations

import dataclasses
import enum
from itertools import repeat
from typing import Any

from torch import Tensor

from .containers import (
    ATOMS,
    LEAF,
    InconsistentMapping,
    TooManyChildren,
    TreeDef,
    describe_value,
    is_dataclass_instance,
    is_namedtuple,
    key_names,
    node_kind,
    node_parts,
)
from .specs import ITEMS, REDUCTIONS, Leaf, Spec, is_int, is_leaf_spec, path_text

MAX_VALUES = 1_000_000  # values one walk reads (leaves and containers): a bigger tree is refused, not walked
# the dict keys a key holds, compared by value (others make a value that is walked in full at every call)
_VALUE_KEYS = (str, int, float, bool, bytes, complex, type(None), enum.Enum)


_TENSOR = frozenset({Tensor})


def only_atoms(value: Any, kind: str | None) -> bool:
    """A non-empty list, tuple or dict of plain numbers and strings only (checked without copying it)."""
    if kind in ("list", "tuple"):
        items = value
    elif kind == "dict" and type(value) is dict:
        items = value.values()
    else:
        return False
    return len(items) > 0 and ATOMS.issuperset(map(type, items))


def _plain_keys(keys: tuple) -> bool:
    return all(isinstance(k, _VALUE_KEYS) or (type(k) is tuple and _plain_keys(k)) for k in keys)


class Walk:
    """Walks that share one budget of :data:`MAX_VALUES` values (a call's arguments, one after the other), into one
    list of leaf values, and either the key (``records`` None) or one Leaf record per leaf (``records`` a list).

    ``key`` holds the structure, in walk order: one entry per container (its kind, type, and its keys or length)
    and a 0 per leaf; with the leaves' facts it is the value's key (equal keys: the same program). ``cacheable``
    turns False for a value whose structure cannot be compared by value (a dict keyed by objects), which is then
    compiled at every call."""

    __slots__ = ("default", "what", "values", "records", "key", "cacheable", "whole_atoms", "arg", "budget", "active")

    def __init__(self, default: Spec, what: str, records: list[Leaf] | None = None, whole_atoms: bool = True):
        self.default, self.what, self.records, self.whole_atoms = default, what, records, whole_atoms
        self.values: list = []
        self.key: list = []
        self.cacheable = True
        self.arg = -1
        self.budget = MAX_VALUES
        self.active: set[int] | None = None  # ids of the containers on the current path (made at the first)

    def run(self, value: Any, spec: Spec, where: Any, explicit: bool, arg: int = -1) -> TreeDef:
        """Walk one value; its leaves belong to top-level argument ``arg``. Returns its TreeDef."""
        self.arg = arg
        if (type(spec) is int or spec is None) and type(value) is Tensor:  # an argument that is one tensor
            if self.records is not None:
                self.records.append(Leaf(where, value, spec, explicit, arg, len(self.values)))
            self.values.append(value)
            self.key.append(0)
            return LEAF
        top = self.open(value, spec, where, explicit)
        if top is None:
            return LEAF
        if type(top) is TreeDef:
            return top
        values, records, key, frames = self.values, self.records, self.key, [top]
        while frames:
            node, children, where, kind = frames[-1]
            kids = node.children
            for k, v, s, e in children:
                # the common leaf (a tensor or None under an int/None spec) inline; everything else opens
                if (type(s) is int or s is None) and (v is None or type(v) is Tensor):
                    if records is not None:
                        records.append(Leaf((where, kind, k), v, s, e, arg, len(values)))
                    values.append(v)
                    key.append(0)
                    kids.append(LEAF)
                    continue
                frame = self.open(v, s, (where, kind, k), e)
                if frame is None:
                    kids.append(LEAF)
                    continue
                if type(frame) is TreeDef:  # a container of tensors, walked at once
                    kids.append(frame)
                    continue
                kids.append(frame[0])
                frames.append(frame)
                break
            else:
                frames.pop()
                self.active.discard(id(node.orig))  # type: ignore[union-attr]
        return top[0]

    def tensors(self, tdef: TreeDef, values: tuple, spec: Spec, where: Any, explicit: bool) -> TreeDef:
        """A container of plain tensors under one int/None spec (a list of many small tensors), walked at once."""
        if self.records is not None:
            kind, arg, n = tdef.kind, self.arg, len(self.values)
            self.records.extend(
                Leaf((where, kind, k), v, spec, explicit, arg, n + i) for i, (k, v) in enumerate(zip(tdef.keys, values))
            )
        self.values.extend(values)
        self.key.extend([0] * len(values))
        tdef.children = [LEAF] * len(values)
        return tdef

    def leaf(self, value: Any, kind: str | None, spec: Spec, where: Any, explicit: bool) -> None:
        if spec == ITEMS and value is not None and (kind not in ("list", "tuple") or is_namedtuple(value)):
            path = path_text(where)
            raise TypeError(
                f"{self.what} for `{path}` is 'items', but `{path}` is {describe_value(value)}; 'items' is for a list "
                "or tuple of per-sample items (for a tensor, give its batch axis as an int)"
            )
        if self.records is not None:
            self.records.append(Leaf(where, value, spec, explicit, self.arg, len(self.values)))
        self.values.append(value)
        self.key.append(0)

    def open(self, value: Any, spec: Spec, where: Any, explicit: bool) -> tuple | TreeDef | None:
        """Emit ``value`` as a leaf (returns None), or open it as a container: ``(TreeDef, children, where, kind)``
        where children yields ``(key, value, spec, explicit)`` (or its TreeDef, a container of tensors walked at
        once)."""
        kind = node_kind(value)
        if is_leaf_spec(spec):
            # under an explicit int spec each element is walked, so the error names the first that is no tensor;
            # under a reduction each is added up
            whole = (
                self.whole_atoms
                and not (explicit and is_int(spec))
                and spec not in REDUCTIONS
                and only_atoms(value, kind)
            )
            if kind is None or spec == ITEMS or whole:
                self.leaf(value, kind, spec, where, explicit)
                return None
            meta, keys, values = self.read(value, kind, where)
            specs: Any = repeat(spec)
            explicits: Any = repeat(explicit)
        else:
            spec = self.container_spec(value, kind, spec, where)
            meta, keys, values = self.read(value, kind, where)
            specs, explicits = self.child_specs(value, kind, keys, spec, where)
        if self.active is None:
            self.active = set()
        elif id(value) in self.active:
            noun = "output" if self.what == "out_dims" else "argument"
            raise ValueError(
                f"`{path_text(where)}` is a {type(value).__name__} that contains itself (it is one of the containers "
                f"above it, so the walk would never end); dpfast cannot walk a cyclic {noun}: break the cycle, or "
                "pass it inside an object dpfast passes by reference (one that is not a container)"
            )
        self.key.append(self.container_key(kind, value, keys))
        tdef = TreeDef(kind, meta, keys, value, values)
        if (type(spec) is int or spec is None) and values and _TENSOR.issuperset(map(type, values)):
            return self.tensors(tdef, values, spec, where, explicit)
        self.active.add(id(value))
        return tdef, zip(keys, values, specs, explicits), where, kind

    def container_key(self, kind: str, value: Any, keys: tuple) -> tuple:
        """A container's entry in the key: its kind and type, and its length (a sequence) or its keys, which
        must compare by value."""
        if kind in ("tuple", "list", "namedtuple"):
            return (kind, type(value), len(keys))
        if kind == "pytree":
            keys = tuple(key_names(kind, keys))
        if self.cacheable and not _plain_keys(keys):
            self.cacheable = False
        return (kind, type(value), keys, tuple(map(type, keys)))

    def read(self, value: Any, kind: str, where: Any) -> tuple[Any, tuple, tuple]:
        """The container's parts, with user code's failures and unbounded containers worded for the path."""
        try:
            parts = node_parts(value, kind, self.budget)
        except TooManyChildren as exc:
            raise ValueError(
                f"`{path_text(where)}` ({type(value).__name__} of {exc.args[0]:,} values) takes the walk past "
                f"{MAX_VALUES:,} values (leaves and containers), the most dpfast reads from a call's "
                f"{'outputs' if self.what == 'out_dims' else 'arguments'}; pass large data as a tensor (torch.tensor "
                "for numbers), or inside an object dpfast passes by reference (one that is not a container)"
            ) from None
        except InconsistentMapping as exc:
            raise ValueError(
                f"`{path_text(where)}` is a {type(value).__name__} whose items go on past its len() ({exc.args[0]}); "
                "dpfast walks a Mapping by its items: make its iteration end at len(), or pass it inside an object "
                "dpfast passes by reference"
            ) from None
        except Exception as exc:  # noqa: BLE001 - the user's container raised: say where
            raise TypeError(
                f"reading the children of `{path_text(where)}` ({type(value).__name__}) raised "
                f"{type(exc).__name__}: {exc}"[:500]
            ) from exc
        self.budget -= len(parts[2]) + 1
        return parts

    def container_spec(self, value: Any, kind: str | None, spec: Spec, where: Any) -> Spec:
        """Check a container spec fits ``value``'s kind (a dataclass spec becomes a dict of its fields)."""
        what = self.what
        if is_dataclass_instance(spec):
            # a dataclass instance as the spec of a value of the same dataclass: every field holds that field's spec
            if type(value) is not type(spec):
                raise TypeError(
                    f"{what} for `{path_text(where)}` is a {type(spec).__name__} instance, but `{path_text(where)}` "
                    f"is {describe_value(value)}; a dataclass spec matches a value of the same dataclass (use a dict "
                    "keyed by field names otherwise)"
                )
            spec = {f.name: getattr(spec, f.name, None) for f in dataclasses.fields(spec)}
        if isinstance(spec, (tuple, list)):
            if kind not in ("tuple", "list", "namedtuple", "pytree"):
                raise TypeError(
                    f"{what} for `{path_text(where)}` is a {type(spec).__name__} of {len(spec)} specs, but "
                    f"`{path_text(where)}` is {describe_value(value)}; give one int/None for it, or a spec mirroring "
                    "its structure"
                )
        elif kind not in ("dict", "namedtuple", "dataclass", "pytree", "object"):
            raise TypeError(
                f"{what} for `{path_text(where)}` is a dict with keys {list(spec)!r}, but `{path_text(where)}` is "
                f"{describe_value(value)}; a dict spec matches a mapping (by key) or a namedtuple/dataclass (by "
                "field name)"
            )
        return spec

    def child_specs(self, value: Any, kind: str, keys: tuple, spec: Spec, where: Any) -> tuple[list, list]:
        """Each child's spec and whether the user gave it, for a container spec (one mirroring the value)."""
        if isinstance(spec, (tuple, list)):
            if len(spec) != len(keys):
                raise ValueError(
                    f"{self.what} for `{path_text(where)}` has {len(spec)} specs but `{path_text(where)}` is "
                    f"{describe_value(value)}; give one spec per element, or a single int/None for all of them"
                )
            return list(spec), [True] * len(keys)
        names = key_names(kind, keys)
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise ValueError(
                f"{self.what} for `{path_text(where)}` names {unknown!r}, which `{path_text(where)}` does not have; "
                f"it is {describe_value(value)}"
            )
        given = [k in spec for k in names]
        return [spec[k] if g else self.default for k, g in zip(names, given)], given


def walk(
    value: Any,
    spec: Spec,
    path: str,
    default: Spec,
    explicit: bool,
    what: str,
    records: list[Leaf] | None,
):
    """One value walked with its spec: ``(TreeDef, leaf values, structure or None)`` (None: it cannot be compared
    by value), with one Leaf record per leaf appended to ``records`` when given."""
    w = Walk(default, what, records)
    tdef = w.run(value, spec, path, explicit)
    return tdef, w.values, tuple(w.key) if w.cacheable else None
