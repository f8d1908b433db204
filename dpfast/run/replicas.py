"""One module per replica, kept between calls as a speed device, never a semantic one.

**What a replica holds.** The first slot on the module's own device is the module itself. Every other slot gets a
:class:`~dpfast.run.replica_copies.Replica`: a copy of each module of the tree that shares the module's attribute
values (a shallow copy of its ``__dict__``, as ``torch.nn.parallel.replicate`` makes), with its children, hook
dicts and the callables bound to modules of the tree (``m.forward = MethodType(f, m)``, partials, closures over
``self``; :mod:`dpfast.run.rebinding`) moved to the copy. Its parameters are in its ``_parameters``, as on the
module: the module's own Parameters on the module's device (no copy: gradients sum onto them), that device's
broadcast copy elsewhere (one coalesced broadcast per device, connected to the originals by autograd, through
:mod:`dpfast.move.broadcast`). Its buffers are its own, cloned from the module's for each call.

**Sets, and when they are refreshed.** A :class:`_ReplicaSet` holds one replica per slot, keyed by device and
occurrence (the second replica on ``cpu``), built on first use, so one set serves every replica count a workload
uses (a batch smaller than the device count runs the first slots). A call *leases* a set, and before any replica
runs, the slots it uses are refreshed: what earlier forwards changed on the copies is undone, the module's hooks
are copied, and this call's parameters and fresh buffers are written in; the set's other slots drop their tensors.

**When a lease ends.** The call's autograd graph may still read its replicas after the call (``torch.utils.
checkpoint`` recomputes a forward from the replica's modules; a full backward hook gets the replica), so the set
stays leased to the graph while both hold: the graph is alive (a token in the metadata of the outputs' ``grad_fn``
nodes, watched through a weak reference) and something outside the set references one of its replica modules
(their reference counts are above the set's own, taken when it was refreshed). A leased set is never refreshed or
cleared: a later call (another replica count, ``no_grad``, ``inference_mode``, another thread) takes another free
set, or builds one. A call without a graph (``no_grad``, ``inference_mode``, outputs that need no grad) ends its
lease when it returns. At most :attr:`ReplicaCache.max_sets` sets are kept; past that the oldest leased one is
forgotten (it lives on through its graph, and goes with it).

**When sets are dropped.** A :class:`~dpfast.run.replica_copies.SourceSnapshot` snapshots the module tree (each module's
class and dicts, shallow); every call checks by identity that none changed. That catches parameters or buffers
added, removed or replaced (``load_state_dict(assign=True)``, ``.to()`` under
``torch.__future__.set_overwrite_module_params_on_conversion(True)``), submodules replaced anywhere, a ``__class__``
swap, ``train()``/``eval()``, a bound ``forward`` and any attribute reassigned. Then every set of the old tree goes
at that call: free ones are cleared and dropped, leased ones forgotten (they live exactly as long as their graph):
nothing of an old module tree outlives the next call but what a pending graph itself holds. In-place changes
(``.to()``'s usual conversion, ``load_state_dict``'s copy, an optimizer step) need no rebuild: values are taken
from the module at every call. A module that reassigns an attribute of itself in every forward is rebuilt every
call: correct, and no slower than torch's replicate.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..move.broadcast import broadcast, buffer_copies, fresh
from ..trees.flatten import flatten
from .replica_copies import Replica, SourceSnapshot, refuse_unreplicable, undo_all
from .shallow_snapshots import all_same, snap
from .write_watch import WriteWatch

# Private test switch: when true, every slot after the first on the source device gets its own full copy of the
# parameters (as if it were another device), so that the copy machinery (broadcast, refresh, invalidation,
# gradients summing back onto the source) runs and is tested on the CPU, with autograd-connected clones instead of
# a CUDA broadcast. Never set it in real use: copies on the source device only cost time and memory.
_COPY_ON_SOURCE_DEVICE = False
_TOKEN = "dpfast.replica_lease"  # the key of the lease token in a grad_fn's metadata


def check_module_device(module: nn.Module, source: torch.device) -> None:
    """torch.nn.DataParallel's rule: parameters and buffers live on ``device_ids[0]``."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device != source:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {source} (device_ids[0]) but found one of "
                f"them on device: {t.device}; move it there first (module.to({str(source)!r}))"
            )


_TREE_DICTS = operator.attrgetter("_modules", "_parameters", "_buffers")
_IS_CPU = operator.attrgetter("is_cpu")
_CPU = torch.device("cpu")


def _tree_dicts(modules: list[nn.Module]) -> list[dict]:
    return list(itertools.chain.from_iterable(map(_TREE_DICTS, modules)))


def _slots(source: torch.device, devices: Sequence[torch.device]) -> list[tuple[torch.device, int] | None]:
    """For each entry of ``devices``: None (the module itself: the first entry on the source device), or the slot
    of its replica, ``(device, how many replicas on that device come before it)``."""
    out: list[tuple[torch.device, int] | None] = []
    seen: dict[torch.device, int] = {}
    for d in devices:
        k = seen.get(d, 0)
        seen[d] = k + 1
        out.append(None if d == source and k == 0 else (d, k - 1 if d == source else k))
    return out


@functools.lru_cache(maxsize=64)
def _layout(source: torch.device, devices: tuple[torch.device, ...]) -> tuple[tuple, tuple, tuple[int, ...]]:
    """What a lease on ``devices`` uses, checked once per device list: :func:`_slots`, the replicas' slots alone,
    and the entries on ``source`` (the module itself first, then its replicas). Raises as :func:`_check_copyable`
    (an exception is not cached)."""
    slot_of = tuple(_slots(source, devices))
    slots = tuple(s for s in slot_of if s is not None)
    if slots:
        _check_copyable(source, [d for d, _ in slots])
    return slot_of, slots, tuple(i for i, d in enumerate(devices) if d == source)


@functools.lru_cache(maxsize=64)
def _groups_of(slots: tuple, source: torch.device, copy_on_source: bool) -> tuple[tuple, tuple, tuple]:
    """Each slot's parameter group: replicas on the source device use the module's own parameters (group None);
    each other device gets one copy shared by its replicas (the test switch: one copy per source-device replica).
    Also the groups that are copies, and their devices."""
    groups = tuple(None if d == source and not copy_on_source else (d, k if d == source else 0) for d, k in slots)
    copy_groups = tuple(dict.fromkeys(g for g in groups if g is not None))
    return groups, copy_groups, tuple(g[0] for g in copy_groups)


def _check_copyable(source: torch.device, devices: Sequence[torch.device]) -> None:
    others = [d for d in dict.fromkeys(devices) if d != source]
    if others and (source.type != "cuda" or any(d.type != "cuda" for d in others)):
        raise ValueError(
            f"cannot copy a module on {source} to {', '.join(map(str, others))}: copies are made for CUDA devices "
            "only; use one device type in device_ids"
        )


class _GraphToken:
    """Kept alive by a call's autograd graph (in its outputs' grad_fn metadata): while it lives, so may the graph."""

    __slots__ = ("__weakref__",)


class _ReplicaSet:
    """Replicas of one :class:`SourceSnapshot`, one per slot, built on first use, leased to one call (and its graph)
    at a time."""

    def __init__(self, snapshot: SourceSnapshot):
        self.snapshot = snapshot
        self.replicas: dict[tuple[torch.device, int], Replica] = {}
        self.lock = threading.Lock()  # held while a call runs on the set
        self.graph: weakref.ref | None = None  # the last call's graph token
        self._flat: list[nn.Module] = []  # every replica module, for the reference counts
        self._own_refs: list[int] = []

    def _refcounts(self) -> list[int]:
        return list(map(sys.getrefcount, self._flat))

    def leased(self) -> bool:
        """Whether the last call's graph may still read these replicas (see the module docstring)."""
        token = self.graph() if self.graph is not None else None
        return token is not None and self._refcounts() != self._own_refs

    def refresh(self, slots: Sequence[tuple[torch.device, int]], source: torch.device) -> list[nn.Module]:
        """This call's tensors into ``slots``' replicas (built if new); the other replicas drop theirs."""
        self.graph = None
        for key in slots:
            if key not in self.replicas:
                self.replicas[key] = Replica(self.snapshot)
                self._flat.extend(self.replicas[key].modules)
        used = [self.replicas[key] for key in slots]
        undo_all(used)
        if len(used) < len(self.replicas):
            for key, replica in self.replicas.items():
                if key not in slots:
                    replica.clear()
        detach = not torch.is_grad_enabled()
        params, buffers = self.snapshot.params, self.snapshot.buffers  # the module's very tensors, while valid
        groups, copy_groups, copy_devices = _groups_of(tuple(slots), source, _COPY_ON_SOURCE_DEVICE)
        if copy_devices:
            pcopies = broadcast(params, source, copy_devices, detach)
            bcopies = buffer_copies(buffers, source, copy_devices, detach)
        taken: set = set()
        for replica, g in zip(used, groups):
            # every replica gets buffers of its own: the first on a copy device takes that device's copy, the
            # others (and the replicas on the source device) clone theirs
            if g is None:
                own = [fresh(b, detach) for b in buffers] if buffers else buffers
                mine = params
            else:
                c = copy_groups.index(g)
                own = bcopies[c] if g not in taken else [fresh(b, detach) for b in bcopies[c]]
                taken.add(g)
                mine = pcopies[c]
            replica.write(mine, own)
        used = replica = None  # (no local may hold a replica module when the counts are taken)
        self._own_refs = self._refcounts()
        return [self.replicas[key].root for key in slots]

    def clear(self) -> None:
        for replica in self.replicas.values():
            replica.clear()


class Lease:
    """One call's replicas: ``modules`` (one per device entry), ``watch`` (the write check for the replicas that
    share the module's device, or None) and :meth:`end`, called when the forward has run."""

    def __init__(self, cache: ReplicaCache | None, rs: _ReplicaSet | None, modules: list, watch: WriteWatch | None):
        self.modules = modules
        self.watch = watch
        self._cache, self._set = cache, rs

    def end(self, outputs: Any = None, interrupted: bool = False) -> None:
        """The call is over: lease the set to the graph of ``outputs`` (its tensors' grad_fn nodes), if any; an
        ``interrupted`` call's set is never used again (a worker may still be running on it)."""
        rs, self._set = self._set, None
        if rs is None:
            return
        if interrupted and self._cache is not None:
            self._cache.forget(rs)
        elif outputs is not None and torch.is_grad_enabled():
            rs.graph = _lease_to_graph(outputs)
        self.modules = []
        rs.lock.release()


def _lease_to_graph(outputs: Any) -> weakref.ref | None:
    """A token kept alive by the graph behind ``outputs`` (None when no output has a graph)."""
    token = None
    try:
        leaves = flatten(outputs, whole_atoms=True)[0]  # (tensors are all it looks for)
    except ValueError:  # a cyclic or unbounded output: gathering refuses it next, naming the output's path
        return None
    for leaf in leaves:
        fn = getattr(leaf, "grad_fn", None) if isinstance(leaf, torch.Tensor) else None
        meta = getattr(fn, "metadata", None) if fn is not None else None
        meta = meta() if callable(meta) else meta  # a property of a graph node, a method of the abstract Node
        if isinstance(meta, dict):
            token = token or _GraphToken()
            meta[_TOKEN] = token
    return None if token is None else weakref.ref(token)


class ReplicaCache:
    """The replica sets of one module (one per call running or leased to a pending graph; usually one)."""

    max_sets = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._source: SourceSnapshot | None = None
        self._sets: list[_ReplicaSet] = []  # most recently used first
        self._module_list: tuple | None = None
        self.builds = 0  # how many sets were built (tests read it)
        self.reported: set = set()  # the module writes a WriteWatch has warned about

    def __reduce__(self):  # deepcopy / pickle of the owning DataParallel: start empty
        return (ReplicaCache, ())

    def _tree(self, root: nn.Module) -> tuple[list[nn.Module], list[torch.Tensor]]:
        """``list(root.modules())`` and their parameters and buffers (tied ones as often as they are held), cached
        while no module's ``_modules``, ``_parameters`` or ``_buffers`` changed (one identity check each, in one
        call)."""
        cached = self._module_list
        if cached is not None and cached[0] is root and all_same(_tree_dicts(cached[1]), *cached[2:4]):
            return cached[1], cached[4]
        modules = list(root.modules())
        if any(isinstance(m, torch.jit.ScriptModule) for m in modules):  # (its dicts are views: none kept)
            return modules, [*root.parameters(), *root.buffers()]
        dicts = _tree_dicts(modules)
        snaps = [snap(d) for d in dicts]
        tensors = [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
        self._module_list = (root, modules, [k for k, _ in snaps], [v for _, v in snaps], tensors)
        return modules, tensors

    def check_module(self, root: nn.Module, source: torch.device, replicated: bool) -> None:
        """:func:`check_module_device` without walking the module tree through generators at every step, and, when
        the call makes ``replicated`` copies, :func:`refuse_unreplicable` (so ``plan()`` raises what the call
        does). While the replicas' snapshot holds, its tensors are the tree's and it passed both checks when it
        was made, and the lease that follows checks it again: one set of snapshots per call to read, not two."""
        snapshot = self._source
        valid = snapshot is not None and snapshot.valid(root)
        if replicated and not valid:
            refuse_unreplicable(root)
        tensors = snapshot.params_and_buffers if valid else self._tree(root)[1]  # type: ignore[union-attr]
        if source == _CPU and all(map(_IS_CPU, tensors)):  # (no device object made per tensor)
            return
        for t in tensors:
            if t.device != source:
                check_module_device(root, source)  # the full walk and its message
                return

    def forget(self, rs: _ReplicaSet) -> None:
        with self._lock:
            if rs in self._sets:
                self._sets.remove(rs)

    def lease(self, module: nn.Module, source: torch.device, devices: Sequence[torch.device]) -> Lease:
        """One module per entry of ``devices`` (``module`` itself for the first on ``source``, a replica for every
        other), refreshed for this call; :meth:`Lease.end` when the call's forward has run."""
        slot_of, slots, on_source = _layout(source, tuple(devices))
        if not slots:
            return Lease(None, None, [module] * len(devices), None)
        rs, stale = self._take(module)
        _clear_free(stale)
        try:
            replicas = iter(rs.refresh(slots, source))
        except BaseException:
            rs.clear()
            rs.lock.release()
            raise
        modules = [module if s is None else next(replicas) for s in slot_of]
        watch = None
        if len(on_source) > 1:
            watch = WriteWatch(rs.snapshot, on_source, self.reported)
        return Lease(self, rs, modules, watch)

    def _take(self, module: nn.Module) -> tuple[_ReplicaSet, list[_ReplicaSet]]:
        """A free set of the module's current tree, locked for this call (built if none is free), and the sets
        to clear: the free ones of this tree that hold another call's tensors, and every free one of an old tree."""
        with self._lock:
            stale: list[_ReplicaSet] = []
            if self._source is None or not self._source.valid(module):
                stale, self._sets = self._sets, []
                self._source = SourceSnapshot(module)
            chosen = None
            for rs in self._sets:
                if chosen is None and rs.lock.acquire(blocking=False):
                    if not rs.leased():
                        chosen = rs
                        continue
                    rs.lock.release()
                elif chosen is not None and not rs.leased():
                    stale.append(rs)  # cleared below, but kept: the next call may want it
            if chosen is None:
                chosen = _ReplicaSet(self._source)
                chosen.lock.acquire()
                self.builds += 1
            else:
                self._sets.remove(chosen)
            self._sets.insert(0, chosen)
            while len(self._sets) > self.max_sets:
                self._sets.pop()  # the oldest: leased (or in use by another thread), so it lives on its own
            return chosen, [s for s in stale if s is not chosen]


def _clear_free(sets: Sequence[_ReplicaSet]) -> None:
    """Drop the tensors of every set no call is using and no graph still leases."""
    for rs in sets:
        if rs.lock.acquire(blocking=False):
            try:
                if not rs.leased():
                    rs.clear()
            finally:
                rs.lock.release()


def replicate_once(module: nn.Module, source: torch.device, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One module per entry of ``devices``, as a call makes them (the module itself first on ``source``, a replica
    with buffers of its own for every other entry), but built for this use only: for torch's overridable
    ``DataParallel.replicate``, whose caller keeps the replicas as long as it likes."""
    slot_of = _slots(source, devices)
    slots = [s for s in slot_of if s is not None]
    if not slots:
        return [module] * len(devices)
    _check_copyable(source, [d for d, _ in slots])
    replicas = iter(_ReplicaSet(SourceSnapshot(module)).refresh(slots, source))
    return [module if s is None else next(replicas) for s in slot_of]
