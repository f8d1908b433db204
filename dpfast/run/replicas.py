"""One module per replica: the module itself for the first slot on its device, a replica for every other slot.

Replicas behave like separate devices. A replica on the module's own device (``["cpu"] * 4``, ``[0, 0]``) shares
the module's parameters (no copy: gradients sum onto them) but has its own buffers, cloned from the module's at the
start of each call, and its own attributes: whatever its forward changes is discarded, as it is on another GPU,
so a BatchNorm counts one batch per call (replica 0's) and nothing races. Replicas on another (CUDA) device get
that device's copy of the parameters (one coalesced broadcast per device, shared by its replicas, connected to the
originals by autograd as with ``torch.nn.parallel.replicate``, through ``dpfast.move.broadcast.BroadcastToOthers``,
which makes no copy for the source) and buffers of their own.

The replicas are **persistent**: :class:`ReplicaCache` builds the module tree once per list of replica devices, and
each step only writes the parameters and fresh buffers into the replicas' attribute slots. They stay there until
the next step replaces them, since a backward may need them (``torch.utils.checkpoint`` recomputes a replica's
forward from its module). Attributes a replica's forward set are undone at the next step.

Invalidation: at build time each source module's class, ``__dict__``, ``_parameters``, ``_buffers`` and
``_modules`` are snapshotted (shallow), and each step checks by identity that none of them changed. That catches
parameters or buffers added, removed or replaced (``load_state_dict(assign=True)``, ``.to()`` under
``torch.__future__.set_overwrite_module_params_on_conversion(True)``), submodules added or replaced anywhere in
the tree, a ``__class__`` swap, ``train()``/``eval()`` and any other attribute reassigned on any module. In-place
changes (``.to()``'s usual conversion, ``load_state_dict``'s copy, an optimizer step) need no rebuild: values are
taken from the source at every step. A module that reassigns an attribute of itself in every ``forward`` is
rebuilt every step: correct, and no slower than torch's replicate.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn

from ..move.broadcast import broadcast, buffer_copies, fresh

# Private test switch: when true, every slot after the first on the source device gets its own full copy of the
# parameters (as if it were another device), so that the copy machinery (broadcast, refresh, invalidation,
# gradients summing back onto the source) runs and is tested on the CPU, with autograd-connected clones instead of
# a CUDA broadcast. Never set it in real use: copies on the source device only cost time and memory.
_COPY_ON_SOURCE_DEVICE = False


def check_module_device(module: nn.Module, source: torch.device) -> None:
    """torch.nn.DataParallel's rule: parameters and buffers live on ``device_ids[0]``."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device != source:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {source} (device_ids[0]) but found one of "
                f"them on device: {t.device}; move it there first (module.to({str(source)!r}))"
            )


def _slots(source: torch.device, devices: Sequence[torch.device]) -> tuple[list[int | None], list[torch.device]]:
    """``(slot_of, replica_devices)``: for each entry of ``devices``, None (the module itself: the first entry on
    the source device) or the index of its replica in ``replica_devices`` (one replica per other entry)."""
    slot_of: list[int | None] = []
    replica_devices: list[torch.device] = []
    seen_source = False
    for d in devices:
        if d == source and not seen_source:
            seen_source = True
            slot_of.append(None)
        else:
            slot_of.append(len(replica_devices))
            replica_devices.append(d)
    return slot_of, replica_devices


def _check_copyable(source: torch.device, devices: Sequence[torch.device]) -> None:
    others = [d for d in dict.fromkeys(devices) if d != source]
    if others and (source.type != "cuda" or any(d.type != "cuda" for d in others)):
        raise ValueError(
            f"cannot copy a module on {source} to {', '.join(map(str, others))}: copies are made for CUDA devices "
            "only; use one device type in device_ids"
        )


# The hook registries of an nn.Module that a forward (or backward) consults.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _snap(d: dict) -> tuple[tuple, tuple]:
    """A dict's keys and values, as they are now (shallow)."""
    return tuple(d), tuple(d.values())


def _same(now: dict, snap: tuple[tuple, tuple]) -> bool:
    """``now`` holds exactly ``snap``'s keys, in order, each bound to the very same object (C-speed identity
    checks; a key re-inserted as an equal but other string reads as a change, which only costs a rebuild)."""
    keys, values = snap
    return len(now) == len(keys) and all(map(operator.is_, now, keys)) and all(map(operator.is_, now.values(), values))


def _refuse_compiled(root: nn.Module) -> None:
    """A ``torch.compile``'d module cannot be copied: its OptimizedModule forwards ``_parameters`` and ``_modules``
    to the original, so a copy (torch's replicate too) would empty the original's; a module compiled in place
    (``module.compile()``) keeps a compiled call bound to itself, which every copy would run. Raised before
    anything is changed."""
    for name, m in root.named_modules():
        where = f"`{name}` of the wrapped module" if name else "the wrapped module"
        if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod"):
            what, why = "a torch.compile'd module (OptimizedModule)", "copying it would empty the original's parameters"
        elif m.__dict__.get("_compiled_call_impl") is not None:
            what, why = "compiled in place (module.compile())", "every copy would run the original module"
        else:
            continue
        raise TypeError(
            f"{where} is {what}; its replicas cannot be made ({why}). Compile the wrapper instead: "
            "torch.compile(dpfast.DataParallel(model, ...)), with the module itself uncompiled inside"
        )


def _set_via_setattr(r: nn.Module, key: str, t: torch.Tensor) -> None:
    """A replica's parameter ``key`` on a module whose ``__setattr__`` tracks its weights. Through
    ``Module.__setattr__`` a Parameter (the module's own, on its device) would be registered on the replica at every
    step (global registration hooks firing per replica, a non-empty ``parameters()``). An RNN gets what its
    ``__setattr__`` does without that (the same objects each step, so no re-flattening); other modules a view."""
    names = r.__dict__.get("_flat_weights_names")
    flat = r.__dict__.get("_flat_weights")
    if isinstance(names, list) and isinstance(flat, list) and key in names:
        r.__dict__[key] = t
        flat[names.index(key)] = t
    else:
        setattr(r, key, t.view_as(t) if isinstance(t, nn.Parameter) else t)


class _ReplicaSet:
    """The module tree built once per replica, with the attribute slots each step writes parameters and buffers
    into, and a snapshot of each replica module to undo what a forward changed."""

    def __init__(self, root: nn.Module, source: torch.device, devices: Sequence[torch.device]):
        self.source = source
        self.devices = list(devices)  # one replica per entry
        # Parameter groups: replicas on the source device use the module's own parameters (group None); each other
        # device gets one copy shared by its replicas (the test switch: one copy per source-device replica).
        self.copy_devices: list[torch.device] = []
        self.group: list[int | None] = []
        for d in self.devices:
            if d == source and not _COPY_ON_SOURCE_DEVICE:
                self.group.append(None)
            elif d == source or d not in self.copy_devices:
                self.copy_devices.append(d)
                self.group.append(len(self.copy_devices) - 1)
            else:
                self.group.append(self.copy_devices.index(d))
        _refuse_compiled(root)
        modules = list(root.modules())
        self.modules = modules
        self.snapshots = [
            (type(m), _snap(m.__dict__), _snap(m._parameters), _snap(m._buffers), _snap(m._modules)) for m in modules
        ]
        index = {id(m): i for i, m in enumerate(modules)}
        copies = [[m._replicate_for_data_parallel() for m in modules] for _ in self.devices]
        params = list(root.parameters())  # deduplicated: a tied parameter is broadcast once, as in torch
        param_index = {id(p): k for k, p in enumerate(params)}
        buffers = list(root.buffers())
        buffer_index = {id(b): k for k, b in enumerate(buffers)}
        self.params, self.buffers = params, buffers
        # slots: (replica j, replica module, attribute name, tensor index, via setattr?)
        self.param_slots: list[tuple[int, nn.Module, str, int, bool]] = []
        self.buffer_slots: list[tuple[int, nn.Module, str, int, bool]] = []
        for j, row in enumerate(copies):
            for i, m in enumerate(modules):
                r = row[i]
                r._former_parameters = OrderedDict()  # as torch's replicate (DDP reads it)
                plain = type(m).__setattr__ is nn.Module.__setattr__  # RNNs override it to track _flat_weights
                for key, child in m._modules.items():
                    if child is None:
                        r._modules[key] = None
                    else:
                        setattr(r, key, row[index[id(child)]])
                for key, p in m._parameters.items():
                    if p is None:
                        r._parameters[key] = None
                    else:
                        self.param_slots.append((j, r, key, param_index[id(p)], not plain))
                for key, b in m._buffers.items():
                    if b is None:
                        r._buffers[key] = None
                    else:
                        self.buffer_slots.append((j, r, key, buffer_index[id(b)], not plain))
        self.roots = [row[0] for row in copies]
        # Each replica gets hook dicts of its own, copied from the module's: a forward that registers hooks (HF
        # models install their output-capturing hooks on first use) must not add them to the module's own.
        self.hooked = [(r, m) for row in copies for r, m in zip(row, modules)]
        for r, m in self.hooked:
            for name in _HOOK_DICTS:
                if name in m.__dict__:
                    r.__dict__[name] = OrderedDict(m.__dict__[name])
        self.clear()
        self.pristine = [
            (r, r.__dict__.copy(), dict(r._parameters), dict(r._buffers), dict(r._modules))
            for row in copies
            for r in row
        ]
        self.lock = threading.Lock()

    def valid(self, root: nn.Module) -> bool:
        """Whether the source tree is still the one these replicas were built from (see the module docstring)."""
        modules = self.modules
        if modules[0] is not root:
            return False
        for m, (t, d, p, b, c) in zip(modules, self.snapshots):
            if not (
                type(m) is t  # a __class__ swap leaves the dicts as they were
                and _same(m.__dict__, d)
                and _same(m._parameters, p)
                and _same(m._buffers, b)
                and _same(m._modules, c)
            ):
                return False
        return True

    def _undo_forward_changes(self) -> None:
        """Attributes, submodules, buffers or hooks a replica's forward set in an earlier step: back to the module's.
        (Restoring every replica is cheaper than checking which ones changed.)"""
        for r, d, p, b, c in self.pristine:
            live = r.__dict__
            live.clear()
            live.update(d)
            for now, snap in ((r._parameters, p), (r._buffers, b), (r._modules, c)):
                now.clear()
                now.update(snap)
        for r, m in self.hooked:  # the module's hooks as they are now (the same hook ids in the same order)
            for name in _HOOK_DICTS:
                mine, theirs = r.__dict__.get(name), m.__dict__.get(name)
                if (
                    mine is not None
                    and theirs is not None
                    and (len(mine) != len(theirs) or (theirs and any(map(operator.ne, mine, theirs))))
                ):
                    mine.clear()
                    mine.update(theirs)

    def refresh(self) -> None:
        """Write this step's parameters (the module's own, or a broadcast copy) and fresh buffers into the slots."""
        self.clear()  # the last step's
        self._undo_forward_changes()
        detach = not torch.is_grad_enabled()
        params, buffers = self.params, self.buffers  # the module's very tensors, while valid() holds
        pcopies = broadcast(params, self.source, self.copy_devices, detach)
        bcopies = buffer_copies(buffers, self.source, self.copy_devices, detach)
        # every replica gets buffers of its own: the first on a copy device takes that device's copy, the others
        # (and the replicas on the source device) clone theirs
        taken: set[int] = set()
        own: list[list[torch.Tensor]] = []
        for g in self.group:
            if g is None:
                own.append([fresh(b, detach) for b in buffers])
            elif g not in taken:
                taken.add(g)
                own.append(bcopies[g])
            else:
                own.append([fresh(b, detach) for b in bcopies[g]])
        for j, r, key, k, via_setattr in self.param_slots:
            g = self.group[j]
            t = params[k] if g is None else pcopies[g][k]
            # parameters of a replica live as plain attributes (torch's replicate does the same with setattr); a
            # plain dict write is what Module.__setattr__ does for a tensor that is not a registered Parameter
            if via_setattr:
                _set_via_setattr(r, key, t)
            else:
                r.__dict__[key] = t
            r._former_parameters[key] = t
        for j, r, key, k, via_setattr in self.buffer_slots:
            t = own[j][k]
            if via_setattr:
                setattr(r, key, t)
            else:
                r._buffers[key] = t

    def clear(self) -> None:
        """Drop the last step's tensors (memory, and the autograd graph they belong to) from the slots."""
        for _, r, key, _, via_setattr in self.param_slots:
            if via_setattr:  # e.g. an RNN's _flat_weights list holds them too
                setattr(r, key, None)
            else:
                r.__dict__.pop(key, None)
            r._former_parameters.pop(key, None)
        for _, r, key, _, _ in self.buffer_slots:
            r._buffers[key] = None


class ReplicaCache:
    """Persistent replicas of one module, per set of target devices (the few distinct sets a run needs: the full
    device list, and fewer devices when a batch is smaller than the number of devices)."""

    max_sets = 4

    def __init__(self) -> None:
        self._sets: OrderedDict[tuple, _ReplicaSet] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # how many times replicas were built (tests read it)
        self._tree: tuple | None = None

    def __reduce__(self):  # deepcopy / pickle of the owning DataParallel: start empty
        return (ReplicaCache, ())

    def modules_of(self, root: nn.Module) -> list[nn.Module]:
        """``list(root.modules())``, cached while no module's ``_modules`` changed (one identity check each)."""
        tree = self._tree
        if tree is not None and tree[0] is root and all(map(_same, [m._modules for m in tree[1]], tree[2])):
            return tree[1]
        modules = list(root.modules())
        self._tree = (root, modules, [_snap(m._modules) for m in modules])
        return modules

    def check_module_device(self, root: nn.Module, source: torch.device) -> None:
        """:func:`check_module_device` without walking the module tree through generators at every step."""
        for m in self.modules_of(root):
            for t in itertools.chain(m._parameters.values(), m._buffers.values()):
                if t is not None and t.device != source:
                    check_module_device(root, source)  # the full walk and its message
                    return

    def clear(self) -> None:
        with self._lock:
            self._sets.clear()

    def replicate(
        self, module: nn.Module, source: torch.device, devices: Sequence[torch.device]
    ) -> tuple[list[nn.Module], Callable[[], None]]:
        """``(modules, done)``: one module per entry of ``devices`` (``module`` itself for the first on ``source``, a
        replica for every other) and a function to call when the step's forward has run (it lets the next step
        reuse them; the step's tensors stay in them until then, and the other cached sets' are dropped)."""
        slot_of, replica_devices = _slots(source, devices)
        if not replica_devices:
            return [module] * len(devices), _nothing
        _check_copyable(source, replica_devices)
        key = (tuple(replica_devices), _COPY_ON_SOURCE_DEVICE)
        with self._lock:
            rs = self._sets.get(key)
            if rs is not None and not rs.valid(module):
                del self._sets[key]
                rs = None
            if rs is None:
                rs = _ReplicaSet(module, source, replica_devices)
                self.builds += 1
                self._sets[key] = rs
                while len(self._sets) > self.max_sets:
                    self._sets.popitem(last=False)
            else:
                self._sets.move_to_end(key)
            others = [o for o in self._sets.values() if o is not rs]
        for other in others:  # a set used once (a smaller last batch) must not keep its step's tensors for long
            if other.lock.acquire(blocking=False):
                try:
                    other.clear()
                    other._undo_forward_changes()  # and what its forward set (a cached activation, say)
                finally:
                    other.lock.release()
        if not rs.lock.acquire(blocking=False):
            # the same DataParallel is running in another thread right now: a one-off set for this call
            rs = _ReplicaSet(module, source, replica_devices)
            rs.lock.acquire()
        try:
            rs.refresh()
        except BaseException:
            rs.clear()
            rs.lock.release()
            raise
        modules = [module if s is None else rs.roots[s] for s in slot_of]

        def done() -> None:
            # the step's tensors stay in the slots until the next step replaces them: a backward may still need
            # them (torch.utils.checkpoint recomputes a replica's forward from its module)
            rs.lock.release()

        return modules, done


def _nothing() -> None:
    pass


def replicate_once(module: nn.Module, source: torch.device, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One module per entry of ``devices``, as a call makes them (the module itself first on ``source``, a replica
    with buffers of its own for every other entry), but built for this use only: for torch's overridable
    ``DataParallel.replicate``, whose caller keeps the replicas as long as it likes."""
    slot_of, replica_devices = _slots(source, devices)
    if not replica_devices:
        return [module] * len(devices)
    _check_copyable(source, replica_devices)
    rs = _ReplicaSet(module, source, replica_devices)
    rs.refresh()
    return [module if s is None else rs.roots[s] for s in slot_of]
