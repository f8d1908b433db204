"""Binding ``in_dims`` to ``forward``'s signature (:class:`Binding`), so ``f(x, mask=m)`` and ``f(x, m)`` split
alike, and one call's arguments bound to those names and walked into leaves with their specs
(:class:`BoundArguments`).

Paths are rooted at the argument names from ``forward``'s signature (``x``, ``h[0]``, ``batch['mask']``); without
a usable signature the roots are ``args[i]`` and ``kwargs['name']``.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Sequence
from typing import Any, Callable

from .containers import LEAF, TreeDef
from .facts import leaf_facts
from .flatten import unflatten_from
from .specs import ITEMS, Leaf, Spec, is_int, is_leaf_spec, validate_spec
from .walk import Walk


def forward_of(module: Any) -> Callable:
    """The ``forward`` whose signature names the arguments. ``torch.compile(model)`` returns a wrapper whose
    ``forward`` is ``(*args, **kwargs)``: names in ``in_dims`` would then bind to nothing, so look through it."""
    # (the class's name first: a plain module's getattr of a missing name costs a raised AttributeError)
    inner = getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" else None
    if inner is not None:
        return forward_of(inner)
    return module.forward


class Binding:
    """``in_dims`` resolved against ``forward``'s signature, so ``f(x, mask=m)`` and ``f(x, m)`` split alike.

    ``in_dims`` is ``None`` (every argument uses ``dim``), an ``int`` (that axis for every argument), a sequence
    (spec ``i`` for forward's ``i``-th positional parameter, then the ``*args`` extras), or a dict keyed by forward's
    parameter names (the ``*args``/``**kwargs`` names themselves, or any keyword when forward takes ``**kwargs``).
    """

    def __init__(self, forward: Callable, in_dims: Any, dim: int, caller: str = "DataParallel"):
        if not is_int(dim):
            raise TypeError(f"dim must be an int (the batch axis), got {type(dim).__name__} {dim!r}")
        self.caller = caller  # what a suggested fix is written as a call of
        self._read_signature(forward)
        self._bind(in_dims, dim)

    def rebound(self, in_dims: Any, dim: int) -> Binding:
        """The same signature under other ``in_dims`` and ``dim`` (what a suggested fix builds)."""
        new = copy.copy(self)
        new._bind(in_dims, dim)
        return new

    def _bind(self, in_dims: Any, dim: int) -> None:
        self.dim = dim
        self.user_in_dims = in_dims
        self.default: Spec = dim  # spec for arguments in_dims does not name
        self.by_name: dict[str, Spec] = {}  # parameter name -> spec
        self.by_index: dict[int, Spec] = {}  # positional index -> spec, when forward has no usable signature
        self.extras: dict[int, Spec] = {}  # index into *args extras -> spec (from a sequence in_dims)
        # in_dims keys that only **kwargs can bind (no check can tell them from a typo before a call): a call that
        # lacks one warns, once per name
        self.kwargs_only: list[str] = []
        self._warned: set[str] = set()
        self.programs: Any = None  # planning's call programs for calls bound here, keyed by value
        self._bound: dict[tuple, tuple] = {}  # (positional count, keywords) -> what bind() gives them
        if in_dims is None:
            return
        if is_int(in_dims) or (isinstance(in_dims, str) and in_dims == ITEMS):
            self.default = in_dims
        elif isinstance(in_dims, (tuple, list)):
            self._bind_sequence(in_dims)
        elif isinstance(in_dims, dict):
            self._bind_dict(in_dims)
        else:
            hint = f" (an array: give in_dims={in_dims.tolist()!r})"[:200] if hasattr(in_dims, "tolist") else ""
            raise TypeError(
                f"in_dims must be None, an int, a sequence of specs (by position) or a dict of specs keyed by "
                f"{self.forward_name}'s parameter names; got {type(in_dims).__name__} {in_dims!r}"[:400]
                + hint
            )

    def _read_signature(self, forward: Callable) -> None:
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
        for p in sig.parameters.values() if sig is not None else ():
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

    def _bind_sequence(self, in_dims: Sequence[Spec]) -> None:
        for i, s in enumerate(in_dims):
            validate_spec(s, f"in_dims[{i}]", allow_reductions=False)
        if not self.has_signature:
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

    def _bind_dict(self, in_dims: dict[Any, Spec]) -> None:
        if not self.has_signature:
            raise TypeError(
                f"in_dims is a dict, but the signature of {self.forward_name} cannot be read to bind names; "
                "give in_dims as a sequence by position instead"
            )
        known = self.known_names
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
            if k not in known:
                self.kwargs_only.append(k)
            elif k == self.var_kw and isinstance(s, dict):
                self.kwargs_only.extend(str(n) for n in s if n not in self.named)

    @property
    def parameter_names(self) -> list[str]:
        """forward's named parameters: the positional ones in order, then the keyword-only ones."""
        return self.pos_names + sorted(self.named - set(self.pos_names))

    @property
    def known_names(self) -> list[str]:
        """Every name ``in_dims`` and ``cost`` may start with: the parameters, then ``*args``'s and ``**kwargs``'s."""
        return self.parameter_names + [n for n in (self.var_pos, self.var_kw) if n is not None]

    # -- per call --------------------------------------------------------------------------------------------

    def bind(self, n_args: int, kw_keys: tuple) -> tuple[list[tuple[str, str, Spec, bool]], list[str]]:
        """Per argument of a call with ``n_args`` positional arguments and these keywords, ``(the in_dims name it
        answers to, its path, its spec, whether in_dims gave it)``, and those names; worked out once per such
        call."""
        got = self._bound.get((n_args, kw_keys))
        if got is None:
            bound = [self.positional(i, n_args) for i in range(n_args)] + [self.keyword(k) for k in kw_keys]
            if len(self._bound) >= 64:
                self._bound.clear()
            got = self._bound[(n_args, kw_keys)] = (bound, [b[0] for b in bound])
        return got

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

    def warn_unused(self, kwargs: dict[str, Any]) -> None:
        """Warn (once per name) about in_dims keys bound only through ``**kwargs`` that this call does not pass."""
        missing = [k for k in self.kwargs_only if k not in kwargs and k not in self._warned]
        if not missing:
            return
        self._warned.update(missing)
        passed = ", ".join(sorted(kwargs)) or "none"
        for k in missing:
            warnings.warn(
                f"in_dims names {k!r}, which {self.forward_name} accepts only through **{self.var_kw}, but this call "
                f"does not pass it, so its spec applies to nothing; is it misspelt? (this call's keywords: {passed}; "
                f"named parameters: {', '.join(self.parameter_names)}). "
                "dpfast warns once per name",
                UserWarning,
                stacklevel=5,
            )

    def suggested(self, fixes: dict[str, Spec]) -> tuple[int, Any]:
        """``(dim, in_dims)`` that keep what the user gave and apply ``fixes`` (argument name -> spec)."""
        if self.has_signature:
            merged: dict[str, Spec] = dict(self.by_name)
            merged.update(fixes)
            order = {n: i for i, n in enumerate(self.pos_names)}
            # an int in_dims was a default for every argument; with a dict that default is the `dim` argument
            dim = self.default if is_int(self.default) else self.dim
            return dim, dict(sorted(merged.items(), key=lambda kv: order.get(kv[0], len(order))))
        idx = dict(self.by_index)
        for k, v in fixes.items():  # keys look like "args[3]"
            if k.startswith("args["):
                idx[int(k[5:-1])] = v
        return self.dim, [idx.get(i, self.default) for i in range((max(idx) + 1) if idx else 0)]

    def suggestion(self, fixes: dict[str, Spec]) -> str:
        """Render an ``in_dims=`` that keeps what the user gave and applies ``fixes`` (argument name -> spec)."""
        dim, in_dims = self.suggested(fixes)
        prefix = f"dim={dim!r}, " if dim != self.dim else ""
        if isinstance(in_dims, dict):
            return prefix + "in_dims={" + ", ".join(f"{k!r}: {v!r}" for k, v in in_dims.items()) + "}"
        return prefix + "in_dims=[" + ", ".join(map(repr, in_dims)) + "]"


class BoundArguments:
    """One call's arguments bound to ``forward``'s names and walked: a TreeDef per argument, the leaves' values in
    call order (``flat``: positional, then keyword) and the call's ``key`` (its structure and leaf facts by value,
    see :mod:`dpfast.trees.walk`; None when it cannot be compared by value).

    One :class:`Leaf` record per leaf (its path, spec and argument; planning's marks) is made only when asked for
    (:attr:`leaves`: a plan printed, an error worded), by walking the call again: the same walk, the same leaves."""

    __slots__ = ("binding", "n_args", "kw_keys", "values", "arg_names", "arg_defs", "flat", "key", "program",
                 "_bound", "_leaves")  # fmt: skip

    def __init__(self, binding: Binding, args: Sequence[Any], kwargs: dict[str, Any]):
        self.binding = binding
        self.n_args = n = len(args)
        self.kw_keys = tuple(kwargs)
        self.values = (*args, *kwargs.values()) if kwargs else tuple(args)  # the top-level arguments, as given
        # per argument: (the in_dims name it answers to, its path, spec, whether given); and the names alone
        self._bound, self.arg_names = binding.bind(n, self.kw_keys)
        walk = Walk(binding.default, "in_dims")
        self.arg_defs: list[TreeDef] = self._walk(walk)
        self.flat: list = walk.values
        self.key = (n, self.kw_keys, tuple(walk.key), leaf_facts(self.flat)) if walk.cacheable else None
        self.program: Any = None  # planning's program for this call, which marks the records it makes
        self._leaves: list[Leaf] | None = None
        if binding.kwargs_only:
            binding.warn_unused(kwargs)

    def _walk(self, walk: Walk) -> list[TreeDef]:
        defs = []
        for a, (_, path, spec, explicit) in enumerate(self._bound):
            defs.append(walk.run(self.values[a], spec, path, explicit, a))
        return defs

    @property
    def leaves(self) -> list[Leaf]:
        """One Leaf record per leaf, in call order, with planning's marks (how each is split) once planned."""
        if self._leaves is None:
            records: list[Leaf] = []
            self._walk(Walk(self.binding.default, "in_dims", records))
            if self.program is not None:
                self.program.mark(records)
            self._leaves = records
        return self._leaves

    @property
    def args(self) -> tuple:
        return self.values[: self.n_args]

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(zip(self.kw_keys, self.values[self.n_args :]))

    def value_of(self, name: str) -> Any:
        """The argument ``name`` binds to in this call (``*args``'s name: a tuple of the extras; ``**kwargs``'s: a
        dict of the keywords no parameter names; without a signature ``args``/``kwargs``); KeyError if none."""
        b = self.binding
        if not b.has_signature and name in ("args", "kwargs"):
            return self.args if name == "args" else self.kwargs
        if name == b.var_pos:
            return tuple(v for n, v in zip(self.arg_names[: self.n_args], self.values) if n == name)
        if name == b.var_kw:
            return {k: v for k, v in self.kwargs.items() if k not in b.named and k not in b.pos_names}
        if b.has_signature and name in self.arg_names:
            return self.values[self.arg_names.index(name)]
        raise KeyError(name)

    def rebuild(self, new_leaves: Sequence[Any], own_caches: bool = False) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with the leaves replaced by ``new_leaves`` (same order); ``own_caches``
        makes every KV cache a new object (a replica's own, see :func:`~dpfast.trees.flatten.unflatten_from`)."""
        n = self.n_args
        if len(new_leaves) == len(self.values) and self.arg_defs.count(LEAF) == len(self.arg_defs):
            return tuple(new_leaves[:n]), dict(zip(self.kw_keys, new_leaves[n:]))  # every argument one leaf
        it = iter(new_leaves)
        values = [unflatten_from(d, it, own_caches) for d in self.arg_defs]
        return tuple(values[:n]), dict(zip(self.kw_keys, values[n:]))
