"""Shallow snapshots of dicts, compared and restored by identity: how a call tells that the module tree is still
the one its replicas were copied from, undoes what forwards changed on the copies, and sees a replica write to the
module (:mod:`dpfast.run.replica_copies`, :mod:`dpfast.run.write_watch`).

A snapshot is ``(keys, values)``, two tuples. "The same" means the very same key and value objects in the same
order: no ``__eq__`` runs (a tensor's would compare elements), and a key re-inserted as an equal but other string
reads as a change, which costs only a rebuild. The checks of many dicts run in one call into the extension
(``csrc/python_dicts.cpp``) where it is built, else here, with the same result.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..ext.loader import C as _C

_fast_same = getattr(_C, "_same_dicts", None)
_fast_restore = getattr(_C, "_restore_dicts", None)

Snapshot = tuple[tuple, tuple]


def snap(d: dict) -> Snapshot:
    """A dict's keys and values, as they are now (shallow)."""
    return tuple(d), tuple(d.values())


def same(now: dict, snapshot: Snapshot) -> bool:
    """``now`` holds exactly ``snapshot``'s keys, in order, each bound to the very same object."""
    keys, values = snapshot
    return len(now) == len(keys) and all(map(operator.is_, now, keys)) and all(map(operator.is_, now.values(), values))


def all_same(dicts: Sequence[dict], keys: Sequence[tuple], values: Sequence[tuple]) -> bool:
    """Whether every ``dicts[i]`` is :func:`same` as the snapshot ``(keys[i], values[i])``."""
    if _fast_same is not None:
        out = _fast_same(dicts, keys, values)
        if out is not NotImplemented:  # (declined: an OrderedDict, whose order is not the dict's)
            return out
    if not len(dicts) == len(keys) == len(values):  # (as the extension declines: never a check cut short)
        raise ValueError(f"all_same: {len(dicts)} dicts for {len(keys)} key and {len(values)} value snapshots")
    return all(map(same, dicts, zip(keys, values)))


def restore(lives: Sequence[dict], saved: Sequence[dict]) -> None:
    """``lives[i]`` set back to hold exactly ``saved[i]``'s entries, in order. (The extension leaves a dict that
    already holds them untouched; here only a dict restored onto itself is: the others are cleared and updated,
    with the same result.)"""
    if _fast_restore is not None and _fast_restore(lives, saved) is not NotImplemented:
        return
    if len(lives) != len(saved):
        raise ValueError(f"restore: {len(lives)} dicts for {len(saved)} saved ones")
    for live, d in zip(lives, saved):
        if live is d:
            continue
        live.clear()
        live.update(d)
