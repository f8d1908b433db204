"""Writes to the module's own state made during a replica's turn, in a rehearsal.

Replicas that share the module's device share its attribute values (a replica's ``__dict__`` is a shallow copy)
and its parameters. On separate devices a replica has copies of its own, so it can never change the module: an
in-place update of a shared tensor (a torchmetrics state, a parameter) fails there with a device mismatch, and an
attribute set through a reference to the module itself (a closure, a global) would be a replica writing into
another device's model. The rehearsal must not show a success the GPU run will not give, so such writes are named.

Replicas sharing a device run one at a time (:mod:`dpfast.run.rendezvous`), and the module itself is the first
of its device's replicas to run. The watch snapshots the module tree (each module's ``__dict__`` by identity, and
the version counter of every parameter, buffer and tensor attribute) when the module's own turn ends, and compares
when each other replica's turn ends: a difference was made by that replica. Each write is reported once per
wrapper, after the call (in the caller's thread), as a ``RuntimeWarning`` naming the module path and attribute.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Iterable, Sequence

from torch import Tensor

from .replica_copies import DICT_OF, SourceSnapshot, tensors_of
from .shallow_snapshots import all_same, snap

_VERSION = operator.attrgetter("_version")


def _versions(tensors: Iterable[Tensor]) -> list[int]:
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:  # an inference tensor has no version counter
        return [-1 if t.is_inference() else t._version for t in tensors]


class WriteWatch:
    """Checks the turns of the replicas ``indices`` (the module itself first) of one call."""

    def __init__(self, snapshot: SourceSnapshot, indices: Sequence[int], reported: set):
        self.members = frozenset(indices)
        self.first = indices[0]
        self.snapshot = snapshot
        self.reported = reported
        self._state: tuple | None = None
        self._found: list[tuple[int, str, str, str]] = []  # (replica, module path, attribute, what happened)

    def _take(self) -> tuple:
        """The modules' ``__dict__`` snapshots, their tensors and the tensors' versions, as they are now."""
        s = self.snapshot
        dicts = list(map(DICT_OF, s.modules))
        if all_same(dicts + s.own_dicts, s.keys, s.values):  # as the replicas were copied: still valid
            keys, values, tensors = s.dict_keys, s.dict_values, s.tensors()
        else:
            snaps = [snap(d) for d in dicts]
            keys, values, tensors = [k for k, _ in snaps], [v for _, v in snaps], tensors_of(s.modules)
        return keys, values, tensors, _versions(tensors)

    def turn_ended(self, i: int) -> None:
        """Replica ``i`` gives up its device's turn (it returned, raised, or entered a collective)."""
        if i == self.first:
            self._state = self._take()
            return
        state = self._state
        if state is None or i not in self.members:
            return
        keys, values, tensors, versions = state
        # the same attributes (by identity: a new tensor attribute is a change too), and each tensor's version
        if all_same(list(map(DICT_OF, self.snapshot.modules)), keys, values) and _versions(tensors) == versions:
            return
        self._report(i, keys, values, tensors, versions)
        self._state = self._take()

    def _report(self, i: int, all_keys: list, all_values: list, tensors: list[Tensor], versions: list[int]) -> None:
        """Note what replica ``i`` changed (the slow path, only once something did)."""
        moved = {id(t) for t, v in zip(tensors, versions) if (-1 if t.is_inference() else t._version) != v}
        for m, name, keys, values in zip(self.snapshot.modules, self.snapshot.names, all_keys, all_values):
            before = dict(zip(keys, values))
            owned = itertools.chain(m._parameters.items(), m._buffers.items(), m.__dict__.items())
            for key, v in owned:
                if isinstance(v, Tensor) and id(v) in moved:
                    self._found.append((i, name, key, "was changed in place"))
                elif key in m.__dict__ and (key not in before or before[key] is not v):
                    self._found.append((i, name, key, "was set"))
            self._found.extend((i, name, key, "was deleted") for key in keys if key not in m.__dict__)

    def report(self) -> None:
        """Warn about what the call's replicas wrote (once per module attribute and wrapper); in the caller."""
        new = [f for f in self._found if (f[1], f[2]) not in self.reported]
        self._found = []
        if not new:
            return
        self.reported.update((f[1], f[2]) for f in new)
        who = ", ".join(str(i) for i in dict.fromkeys(f[0] for f in new))
        what = "; ".join(f"`{_path(name, key)}` {how}" for _, name, key, how in new)
        warnings.warn(
            f"dpfast.DataParallel: replica {who}, sharing the module's device in this rehearsal, wrote to the "
            f"module's own state: {what}. On separate devices a replica has copies of its own and cannot change the "
            "module (an in-place write to a shared tensor fails there with a device mismatch), so the rehearsal "
            "would show a success the GPU run will not give. Keep per-call state in buffers (register_buffer: "
            "each replica gets its own), reassign attributes of self instead of updating shared ones in place, "
            "and compute metrics outside the DataParallel call, on the gathered outputs",
            RuntimeWarning,
            stacklevel=4,
        )


def _path(module_name: str, key: str) -> str:
    return f"{module_name}.{key}" if module_name else key
