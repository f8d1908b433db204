"""``in_dims`` / ``out_dims``: bind specs to ``forward``'s signature, match them to argument trees, validate.

A *spec* is a pytree prefix of the value it describes: a leaf spec (``int``, ``None``, and for outputs ``"sum"`` /
``"mean"``) applies to every leaf below it; a tuple/list/dict spec mirrors the value's structure one level down.
A dict spec matches a dict by key or a namedtuple/dataclass by field name (naming a subset; the rest use ``dim``);
an instance of a dataclass matches a value of that same dataclass, every field holding that field's spec.

The tree walker is our own and deliberately small: tensors, ``None``, tuples, lists, dicts, namedtuples and
dataclass instances are walked; ``PackedSequence`` is a leaf (it is split by sequence as a whole, see
:mod:`dpfast._transfer`); everything else is an opaque leaf passed by reference.

Paths name a leaf the way you would write it in Python, rooted at the argument name from ``forward``'s signature:
``x``, ``h[0]``, ``batch['mask']``, ``state.h`` (namedtuple or dataclass field). Without a usable signature the
roots are ``args[i]`` and ``kwargs['name']``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Iterable, Sequence
from typing import Any, Callable

from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

Spec = Any  # int | None | str | tuple | list | dict | dataclass instance, nested
REDUCTIONS = ("sum", "mean")

# ---------------------------------------------------------------------------------------------------------------
# The tree walker
# ---------------------------------------------------------------------------------------------------------------


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
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
    if _is_dataclass_instance(obj):
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
    return _unflatten(tdef, iter(leaves))


def _unflatten(tdef: TreeDef, it) -> Any:
    if tdef.kind == "leaf":
        return next(it)
    values = [_unflatten(c, it) for c in tdef.children]
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
# ---------------------------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_leaf_spec(spec: Spec) -> bool:
    return spec is None or _is_int(spec) or isinstance(spec, str)


def validate_spec(spec: Spec, where: str, allow_reductions: bool) -> None:
    """Raise TypeError/ValueError if ``spec`` holds anything but ints, None, containers (and reductions)."""
    if spec is None or _is_int(spec):
        return
    if isinstance(spec, str):
        if allow_reductions and spec in REDUCTIONS:
            return
        if allow_reductions:
            raise ValueError(
                f"{where} is {spec!r}, which is not a known reduction; use an int (concatenate along that axis), "
                "None (replica 0's value), 'sum' or 'mean'"
            )
        raise TypeError(
            f"{where} is the string {spec!r}; an in_dims spec is an int (the batch axis), None (replicate) or a "
            "tuple/list/dict of specs ('sum'/'mean' are only for out_dims)"
        )
    if isinstance(spec, (tuple, list)):
        for i, s in enumerate(spec):
            validate_spec(s, f"{where}[{i}]", allow_reductions)
        return
    if isinstance(spec, dict):
        for k, s in spec.items():
            validate_spec(s, f"{where}[{k!r}]", allow_reductions)
        return
    if _is_dataclass_instance(spec):  # an instance of the value's dataclass holding a spec in every field
        for f in dataclasses.fields(spec):
            validate_spec(getattr(spec, f.name), f"{where}.{f.name}", allow_reductions)
        return
    allowed = "an int, None, 'sum', 'mean'" if allow_reductions else "an int, None"
    raise TypeError(
        f"{where} is {type(spec).__name__} {spec!r}; a spec is {allowed}, or a tuple/list/dict (or dataclass "
        "instance) of specs mirroring the value"
    )


# ---------------------------------------------------------------------------------------------------------------
# Matching a spec prefix to a value
# ---------------------------------------------------------------------------------------------------------------


class SpecLeaf:
    """One leaf of a value with the spec that applies to it."""

    __slots__ = ("path", "value", "spec", "explicit")

    def __init__(self, path: str, value: Any, spec: Spec, explicit: bool):
        self.path = path
        self.value = value
        self.spec = spec  # int | None | "sum" | "mean"
        self.explicit = explicit  # the user named this argument (or a part of it) in in_dims/out_dims


def match_spec(
    value: Any, spec: Spec, path: str, default: Spec, explicit: bool, what: str, out: list[SpecLeaf]
) -> TreeDef:
    """Flatten ``value``, appending one :class:`SpecLeaf` per leaf to ``out``; returns the TreeDef.

    Dict specs may name a subset of a dict's keys (or a namedtuple's/dataclass's fields); the rest use ``default``
    (the DataParallel's ``dim``), as top-level arguments that ``in_dims`` does not name do.
    """
    kind = node_kind(value)
    if is_leaf_spec(spec):
        if kind is None:
            out.append(SpecLeaf(path, value, spec, explicit))
            return LEAF
        keys, values = children_of(value, kind)
        meta = value if kind == "dataclass" else type(value)
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
    if _is_dataclass_instance(spec):
        # a dataclass instance as the spec of a value of the same dataclass: every field holds that field's spec
        if type(value) is not type(spec):
            raise TypeError(
                f"{what} for `{path}` is a {type(spec).__name__} instance, but `{path}` is {describe_value(value)}; "
                f"a dataclass spec matches a value of the same dataclass (use a dict keyed by field names otherwise)"
            )
        spec = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    if isinstance(spec, (tuple, list)):
        if kind not in ("tuple", "list", "namedtuple"):
            raise TypeError(
                f"{what} for `{path}` is a {type(spec).__name__} of {len(spec)} specs, but `{path}` is "
                f"{describe_value(value)}; give one int/None for it, or a spec mirroring its structure"
            )
        keys, values = children_of(value, kind)
        if len(spec) != len(values):
            raise ValueError(
                f"{what} for `{path}` has {len(spec)} specs but `{path}` is {describe_value(value)}; give one spec "
                "per element, or a single int/None for all of them"
            )
        specs = list(spec)
    elif isinstance(spec, dict):
        if kind not in ("dict", "namedtuple", "dataclass"):
            raise TypeError(
                f"{what} for `{path}` is a dict with keys {list(spec)!r}, but `{path}` is {describe_value(value)}; "
                "a dict spec matches a dict (by key) or a namedtuple/dataclass (by field name)"
            )
        keys, values = children_of(value, kind)
        unknown = [k for k in spec if k not in keys]
        if unknown:
            raise ValueError(
                f"{what} for `{path}` names {unknown!r}, which `{path}` does not have; it is {describe_value(value)}"
            )
        specs = [spec.get(k, _DEFAULT) for k in keys]
    else:  # pragma: no cover - validate_spec rejects everything else at construction
        raise TypeError(f"{what} for `{path}`: unsupported spec {spec!r}")
    meta = value if kind == "dataclass" else type(value)
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
# ---------------------------------------------------------------------------------------------------------------


def forward_of(module: Any) -> Callable:
    """The ``forward`` whose signature names the arguments. ``torch.compile(model)`` returns a wrapper whose
    ``forward`` is ``(*args, **kwargs)``: names in ``in_dims`` would then bind to nothing, so look through it."""
    inner = getattr(module, "_orig_mod", None)
    if inner is not None and type(module).__name__ == "OptimizedModule":
        return forward_of(inner)
    return module.forward


class ArgumentSpecs:
    """``in_dims`` resolved against ``forward``'s signature, so ``f(x, mask=m)`` and ``f(x, m)`` split alike.

    ``in_dims`` is ``None`` (every argument uses ``dim``), an ``int`` (that axis for every argument), a sequence
    (spec ``i`` for forward's ``i``-th positional parameter, then the ``*args`` extras), or a dict keyed by forward's
    parameter names (the ``*args``/``**kwargs`` names themselves, or any keyword when forward takes ``**kwargs``).
    """

    def __init__(self, forward: Callable, in_dims: Any, dim: int):
        if not _is_int(dim):
            raise TypeError(f"dim must be an int (the batch axis), got {type(dim).__name__} {dim!r}")
        self.dim = dim
        self.user_in_dims = in_dims
        try:
            sig: inspect.Signature | None = inspect.signature(forward)
        except (TypeError, ValueError):
            sig = None
        self.has_signature = sig is not None
        self.forward_name = getattr(forward, "__qualname__", getattr(forward, "__name__", "forward"))
        self.pos_names: list[str] = []
        self.named: set[str] = set()
        self.var_pos: str | None = None
        self.var_kw: str | None = None
        if sig is not None:
            for p in sig.parameters.values():
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    self.pos_names.append(p.name)
                    if p.kind == p.POSITIONAL_OR_KEYWORD:
                        self.named.add(p.name)
                elif p.kind == p.KEYWORD_ONLY:
                    self.named.add(p.name)
                elif p.kind == p.VAR_POSITIONAL:
                    self.var_pos = p.name
                elif p.kind == p.VAR_KEYWORD:
                    self.var_kw = p.name
        self.signature_text = f"{self.forward_name}{sig}" if sig is not None else self.forward_name

        self.default: Spec = dim  # spec for arguments in_dims does not name
        self.by_name: dict[str, Spec] = {}  # parameter name -> spec
        self.by_index: dict[int, Spec] = {}  # positional index -> spec, when forward has no usable signature
        self.extras: dict[int, Spec] = {}  # index into *args extras -> spec (from a sequence in_dims)

        if in_dims is None:
            return
        if _is_int(in_dims):
            self.default = in_dims
            return
        if isinstance(in_dims, (tuple, list)):
            for i, s in enumerate(in_dims):
                validate_spec(s, f"in_dims[{i}]", allow_reductions=False)
            if sig is None:
                self.by_index = dict(enumerate(in_dims))
                return
            n = len(self.pos_names)
            if len(in_dims) > n and self.var_pos is None:
                raise ValueError(
                    f"in_dims has {len(in_dims)} specs but {self.signature_text} takes {n} positional "
                    f"argument{'s' if n != 1 else ''}; give at most one spec per positional parameter"
                )
            for i, s in enumerate(in_dims):
                if i < n:
                    self.by_name[self.pos_names[i]] = s
                else:
                    self.extras[i - n] = s
            return
        if isinstance(in_dims, dict):
            if sig is None:
                raise TypeError(
                    f"in_dims is a dict, but the signature of {self.forward_name} cannot be read to bind names; "
                    "give in_dims as a sequence by position instead"
                )
            known = self.pos_names + sorted(self.named - set(self.pos_names))
            known += [n for n in (self.var_pos, self.var_kw) if n is not None]
            for k, s in in_dims.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"in_dims keys are forward's parameter names (str), got {type(k).__name__} {k!r}; "
                        "use a sequence for specs by position"
                    )
                if k not in known and self.var_kw is None:
                    raise TypeError(
                        f"in_dims names {k!r}, which is not a parameter of {self.signature_text}; "
                        f"known names: {', '.join(known) if known else '(none)'}"
                    )
                validate_spec(s, f"in_dims[{k!r}]", allow_reductions=False)
                self.by_name[k] = s
            return
        raise TypeError(
            f"in_dims must be None, an int, a sequence of specs (by position) or a dict of specs keyed by "
            f"{self.forward_name}'s parameter names; got {type(in_dims).__name__} {in_dims!r}"
        )

    # -- per call --------------------------------------------------------------------------------------------

    def positional(self, i: int, n_given: int) -> tuple[str, str, Spec, bool]:
        """``(argument name, path, spec, explicit)`` for the ``i``-th positional argument of a call."""
        if not self.has_signature:
            if i in self.by_index:
                return f"args[{i}]", f"args[{i}]", self.by_index[i], True
            return f"args[{i}]", f"args[{i}]", self.default, False
        if i < len(self.pos_names):
            name = self.pos_names[i]
            if name in self.by_name:
                return name, name, self.by_name[name], True
            return name, name, self.default, False
        j = i - len(self.pos_names)
        var = self.var_pos or "args"
        path = f"{var}[{j}]"
        if j in self.extras:
            return var, path, self.extras[j], True
        if self.var_pos is not None and self.var_pos in self.by_name:
            s = self.by_name[self.var_pos]
            if is_leaf_spec(s):
                return var, path, s, True
            n_extra = n_given - len(self.pos_names)
            if isinstance(s, (tuple, list)) and len(s) == n_extra:
                return var, path, s[j], True
            raise ValueError(
                f"in_dims[{self.var_pos!r}] is {s!r}, but the call passes {n_extra} extra positional arguments "
                f"as *{self.var_pos}; give one spec per extra argument, or one int/None for all"
            )
        return var, path, self.default, False

    def keyword(self, key: str) -> tuple[str, str, Spec, bool]:
        if not self.has_signature:
            return f"kwargs[{key!r}]", f"kwargs[{key!r}]", self.default, False
        if key in self.by_name:
            return key, key, self.by_name[key], True
        if key not in self.named and self.var_kw is not None and self.var_kw in self.by_name:
            s = self.by_name[self.var_kw]
            if is_leaf_spec(s):
                return key, key, s, True
            if isinstance(s, dict) and key in s:
                return key, key, s[key], True
        return key, key, self.default, False

    def suggestion(self, fixes: dict[str, Spec]) -> str:
        """Render an ``in_dims=`` that keeps what the user gave and applies ``fixes`` (argument name -> spec)."""
        if self.has_signature:
            merged: dict[str, Spec] = dict(self.by_name)
            merged.update(fixes)
            order = {n: i for i, n in enumerate(self.pos_names)}
            items = sorted(merged.items(), key=lambda kv: order.get(kv[0], len(order)))
            # an int in_dims was a default for every argument; with a dict that default is the `dim` argument
            prefix = f"dim={self.default!r}, " if self.default != self.dim else ""
            return prefix + "in_dims={" + ", ".join(f"{k!r}: {v!r}" for k, v in items) + "}"
        idx = dict(self.by_index)
        for k, v in fixes.items():  # keys look like "args[3]"
            if k.startswith("args["):
                idx[int(k[5:-1])] = v
        n = max(idx) + 1 if idx else 0
        return "in_dims=[" + ", ".join(repr(idx.get(i, self.default)) for i in range(n)) + "]"


class ArgumentTree:
    """One call's arguments flattened: a TreeDef per argument and the leaves with their specs."""

    __slots__ = ("n_args", "kw_keys", "arg_defs", "arg_names", "leaves", "leaf_arg")

    def __init__(self, specs: ArgumentSpecs, args: Sequence[Any], kwargs: dict[str, Any]):
        self.n_args = len(args)
        self.kw_keys = tuple(kwargs.keys())
        self.arg_defs: list[TreeDef] = []
        self.arg_names: list[str] = []  # the in_dims name each top-level argument answers to
        self.leaves: list[SpecLeaf] = []
        self.leaf_arg: list[int] = []  # leaf -> index of its top-level argument
        items = [specs.positional(i, len(args)) + (a,) for i, a in enumerate(args)]
        items += [specs.keyword(k) + (v,) for k, v in kwargs.items()]
        for a, (name, path, spec, explicit, value) in enumerate(items):
            start = len(self.leaves)
            self.arg_defs.append(match_spec(value, spec, path, specs.default, explicit, "in_dims", self.leaves))
            self.arg_names.append(name)
            self.leaf_arg.extend([a] * (len(self.leaves) - start))

    def rebuild(self, new_leaves: Sequence[Any]) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with the leaves replaced by ``new_leaves`` (same order)."""
        it = iter(new_leaves)
        values = [_unflatten(d, it) for d in self.arg_defs]
        return tuple(values[: self.n_args]), dict(zip(self.kw_keys, values[self.n_args :]))


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
    if tdef.kind in ("dict", "dataclass"):
        return dict(zip(tdef.keys, children))
    return tuple(children)
