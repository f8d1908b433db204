"""Callables a module holds that are bound to modules of its tree, bound to the replica's modules instead.

A module's instance ``__dict__`` (and its hook dicts) can hold callables bound to modules of the tree:
``m.forward = types.MethodType(f, m)`` (accelerate binds forwards this way), ``functools.partial(new_forward, m)``
(accelerate's ``add_hook_to_module``), a closure over ``self`` (torchmetrics wraps ``update`` so), a forward hook
that is a bound method of the root (opacus). A replica's ``__dict__`` is a shallow copy of its module's, so without
rebinding every replica would run the *module's* bound method, on the module's state: replicas > 0 would update the
module's buffers and metrics, which on separate devices they cannot. :func:`rebind` returns the value with every
such binding moved to the replica (as ``copy.deepcopy`` moves bound methods and partials to the copy), leaving
anything else (and anything it cannot rebuild) as it is.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any

from torch import nn

# How deep to look through wrappers (a partial around a closure around a bound method is 3).
_DEPTH = 4


def rebind(value: Any, replica_of: Mapping[int, nn.Module], depth: int = _DEPTH) -> Any:
    """``value`` with every module of the tree it binds (``id(module) -> replica`` in ``replica_of``) replaced
    by that module's replica; the very same object when it binds none."""
    if depth <= 0:
        return value
    if isinstance(value, nn.Module):
        return replica_of.get(id(value), value)
    if isinstance(value, types.MethodType):
        owner = rebind(value.__self__, replica_of, depth - 1)
        func = rebind(value.__func__, replica_of, depth - 1)
        return value if owner is value.__self__ and func is value.__func__ else types.MethodType(func, owner)
    if isinstance(value, functools.partial):
        return _rebind_partial(value, replica_of, depth)
    if isinstance(value, types.FunctionType) and value.__closure__:
        return _rebind_closure(value, replica_of, depth)
    return value


def _rebind_partial(p: functools.partial, replica_of: Mapping[int, nn.Module], depth: int) -> Any:
    func = rebind(p.func, replica_of, depth - 1)
    args = tuple(rebind(a, replica_of, depth - 1) for a in p.args)
    keywords = {k: rebind(v, replica_of, depth - 1) for k, v in p.keywords.items()}
    attrs = _rebind_attributes(p, replica_of, depth)
    same = func is p.func and all(map(_is, args, p.args)) and all(keywords[k] is v for k, v in p.keywords.items())
    if same and attrs is None:
        return p
    try:
        new = type(p)(func, *args, **keywords)
    except TypeError:  # a partial subclass with another constructor: leave it as it is
        return p
    new.__dict__.update(p.__dict__ if attrs is None else attrs)  # functools.update_wrapper's __wrapped__, __doc__...
    return new


def _rebind_closure(f: types.FunctionType, replica_of: Mapping[int, nn.Module], depth: int) -> Any:
    contents = []
    changed = False
    for cell in f.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the closure was made)
            contents.append(cell)
            continue
        new = rebind(v, replica_of, depth - 1)
        changed = changed or new is not v
        contents.append(types.CellType(new) if new is not v else cell)
    attrs = _rebind_attributes(f, replica_of, depth)
    if not changed and attrs is None:
        return f
    new_f = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, tuple(contents))
    new_f.__kwdefaults__ = f.__kwdefaults__
    new_f.__qualname__ = f.__qualname__
    new_f.__module__ = f.__module__
    new_f.__doc__ = f.__doc__
    new_f.__dict__.update(f.__dict__ if attrs is None else attrs)
    return new_f


def _rebind_attributes(obj: Any, replica_of: Mapping[int, nn.Module], depth: int) -> dict | None:
    """A wrapper's ``__dict__`` (``__wrapped__`` from ``functools.wraps``) rebound, or None when nothing changed."""
    d = getattr(obj, "__dict__", None)
    if not d:
        return None
    new = {k: rebind(v, replica_of, depth - 1) for k, v in d.items()}
    return new if any(new[k] is not v for k, v in d.items()) else None


def _is(a: Any, b: Any) -> bool:
    return a is b
