"""``in_dims`` / ``out_dims`` specs: validate them, and walk a value (or every replica's output at once) with its
spec into one :class:`Leaf` record per leaf and a :class:`~dpfast.trees.containers.TreeDef`.

A *spec* is a pytree prefix of the value it describes: a leaf spec (``int``, ``None``, and for outputs ``"sum"`` /
``"mean"``) applies to every leaf below it; a tuple/list/dict spec mirrors the value's structure one level down.
A dict spec matches a mapping by key, a namedtuple/dataclass by field name, a torch pytree node by its children's
keys or a KV cache by attribute (naming a subset; the rest use ``dim``); an instance of a dataclass matches a value
of that same dataclass, every field holding that field's spec. ``"items"`` (in and out) takes the list or tuple
under it as a whole: a sequence of per-sample items, split and concatenated by position.

The walk is iterative (no depth limit but memory), refuses a container that contains itself (naming the path
where the cycle closes), and reads at most :data:`MAX_VALUES` values per walk: past that it refuses the value.
"""

from __future__ import annotations

import dataclasses
import numbers
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
    key_text,
    node_kind,
    node_parts,
)

Spec = Any  # int | None | str | tuple | list | dict | dataclass instance, nested
REDUCTIONS = ("sum", "mean")
ITEMS = "items"  # a sequence of per-sample items
MAX_VALUES = 1_000_000  # values one walk reads (leaves and containers): a bigger tree is refused, not walked


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

    __slots__ = ("_where", "value", "spec", "explicit", "arg", "index", "split", "axis", "size", "problem", "others")

    def __init__(self, where: Any, value: Any, spec: Spec, explicit: bool, arg: int, index: int, others: Any):
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
        self.others = others  # outputs: the other replicas' values here, in replica order; inputs: None

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


# ---- the walk ------------------------------------------------------------------------------------------------------


def match_spec(
    value: Any,
    spec: Spec,
    path: str,
    default: Spec,
    explicit: bool,
    what: str,
    out: list[Leaf],
    others: tuple | None = None,
    *,
    arg: int = -1,
    whole_atoms: bool = False,
) -> TreeDef:
    """Walk ``value`` with ``spec``, appending one :class:`Leaf` per leaf to ``out``; returns the TreeDef.

    Dict specs may name a subset of a dict's keys (or a namedtuple's/dataclass's fields); the rest use ``default``
    (the DataParallel's ``dim``), as top-level arguments that ``in_dims`` does not name do. ``others``: the other
    replicas' outputs, walked in step with ``value`` (each leaf gets their values; a structure that differs is a
    ValueError naming the path). ``whole_atoms``: a container of plain numbers and strings under ``None`` or the
    default spec is one leaf (arguments: it holds no tensor and reaches every replica by reference anyway; outputs:
    only where every replica returned that very object, so the result is the one an element-wise walk gives).
    """
    return Walk(default, what, out, whole_atoms).run(value, spec, path, explicit, others, arg)


class Walk:
    """The state of walks that share one budget of :data:`MAX_VALUES` values and one list of leaves (a call's
    arguments, one after the other): frames of open containers instead of recursion."""

    __slots__ = ("default", "what", "out", "arg", "whole_atoms", "budget", "active")

    def __init__(self, default: Spec, what: str, out: list[Leaf], whole_atoms: bool = False):
        self.default, self.what, self.out, self.whole_atoms = default, what, out, whole_atoms
        self.arg = -1
        self.budget = MAX_VALUES
        self.active: set[int] = set()  # ids of the containers on the current path

    def run(self, value: Any, spec: Spec, where: Any, explicit: bool, others: tuple | None, arg: int = -1) -> TreeDef:
        """Walk one value (see :func:`match_spec`); its leaves belong to top-level argument ``arg``."""
        self.arg = arg
        top = self.open(value, spec, where, explicit, others)
        if top is None:
            return LEAF
        out, frames = self.out, [top]
        while frames:
            node, children, where, kind = frames[-1]
            kids = node.children
            for key, v, s, e, r in children:
                # the common leaf (a tensor or None under an int/None spec) inline; everything else opens
                if (type(s) is int or s is None) and (v is None or isinstance(v, Tensor)):
                    out.append(Leaf((where, kind, key), v, s, e, arg, len(out), r))
                    kids.append(LEAF)
                    continue
                frame = self.open(v, s, (where, kind, key), e, r)
                if frame is None:
                    kids.append(LEAF)
                    continue
                kids.append(frame[0])
                frames.append(frame)
                break
            else:
                frames.pop()
                self.active.discard(id(node.orig))
        return top[0]

    def leaf(self, value: Any, kind: str | None, spec: Spec, where: Any, explicit: bool, others: Any) -> None:
        if spec == ITEMS and value is not None and (kind not in ("list", "tuple") or is_namedtuple(value)):
            path = path_text(where)
            raise TypeError(
                f"{self.what} for `{path}` is 'items', but `{path}` is {describe_value(value)}; 'items' is for a list "
                "or tuple of per-sample items (for a tensor, give its batch axis as an int)"
            )
        self.out.append(Leaf(where, value, spec, explicit, self.arg, len(self.out), others))

    def open(self, value: Any, spec: Spec, where: Any, explicit: bool, others: tuple | None) -> tuple | None:
        """Emit ``value`` as a leaf (returns None), or open it as a container: ``(TreeDef, children, where, kind)``
        where children yields ``(key, value, spec, explicit, others)``."""
        kind = node_kind(value)
        if is_leaf_spec(spec):
            # under an explicit int spec each element is walked, so the error names the first that is no tensor
            whole = (
                self.whole_atoms
                and not (explicit and is_int(spec))
                and (others is None or _taken_whole(value, spec, others))
                and only_atoms(value, kind)
            )
            if kind is None or spec == ITEMS or whole:
                self.leaf(value, kind, spec, where, explicit, others)
                return None
            meta, keys, values = self.read(value, kind, where)
            specs: Any = repeat(spec)
            explicits: Any = repeat(explicit)
        else:
            spec = self.container_spec(value, kind, spec, where)
            meta, keys, values = self.read(value, kind, where)
            specs, explicits = self.child_specs(value, kind, keys, spec, where)
        if id(value) in self.active:
            noun = "output" if self.what == "out_dims" else "argument"
            raise ValueError(
                f"`{path_text(where)}` is a {type(value).__name__} that contains itself (it is one of the containers "
                f"above it, so the walk would never end); dpfast cannot walk a cyclic {noun}: break the cycle, or "
                "pass it inside an object dpfast passes by reference (one that is not a container)"
            )
        self.active.add(id(value))
        rest = self.match_others(value, kind, keys, others, where) if others else repeat(others)
        return TreeDef(kind, meta, keys, value, values), zip(keys, values, specs, explicits, rest), where, kind

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

    def match_others(self, value: Any, kind: str, keys: tuple, others: tuple, where: Any):
        """Per child, the other replicas' values there; raises when a replica's structure differs here."""
        per_replica = []
        for r, other in enumerate(others, start=1):
            same = type(other) is type(value) and node_kind(other) == kind
            other_values: tuple = ()
            if same:
                _, other_keys, other_values = self.read(other, kind, where)
                same = other_keys == keys
            if not same:
                raise ValueError(
                    f"replicas returned different output structures: replica 0 returned {describe_value(value)}, "
                    f"replica {r} returned {describe_value(other)} at `{path_text(where)}`; every replica must return "
                    "the same structure"
                )
            per_replica.append(other_values)
        return zip(*per_replica)


def _taken_whole(value: Any, spec: Spec, others: tuple) -> bool:
    """An output of atoms is one leaf only where walking it would give the same: every replica returned this very
    object (so each element would come back as replica 0's) and the spec keeps it (a reduction adds elements up)."""
    return (spec is None or is_int(spec)) and all(o is value for o in others)


def only_atoms(value: Any, kind: str | None) -> bool:
    """A non-empty list, tuple or dict of plain numbers and strings only (checked without copying it)."""
    if kind in ("list", "tuple"):
        items = value
    elif kind == "dict" and type(value) is dict:
        items = value.values()
    else:
        return False
    return len(items) > 0 and ATOMS.issuperset(map(type, items))
