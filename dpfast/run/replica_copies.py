"""The two halves of a replica: :class:`SourceSnapshot`, what the module's tree looked like when its replicas were built
(and whether it still does), and :class:`Replica`, one copy of that tree for one device slot, with the attribute
slots each call writes its parameters and buffers into (or, on the module's own device, finds its parameters in).
:mod:`dpfast.run.replicas` says when either is made, used and dropped.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict

import torch
from torch import nn

from .rebinding import rebind
from .shallow_snapshots import all_same, restore, snap

# The hook registries of an nn.Module that a forward (or backward) consults.
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
# What a replica's __dict__ holds that is not rebound value by value: its own registries.
_OWN_DICTS = frozenset(HOOK_DICTS) | {"_parameters", "_buffers", "_modules", "_former_parameters"}


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


def _refuse_per_sample_gradients(root: nn.Module) -> None:
    """opacus' GradSampleModule keeps one ``grad_sample`` per parameter, filled by the module's forward and
    backward on one batch. Replicas each see a chunk: their rows would be added onto the same rows (or be lost on
    another device's copy), so the per-sample gradients would not cover the batch. Refused, before anything runs."""
    for name, m in root.named_modules():
        if any(c.__module__.startswith("opacus") and c.__name__ == "AbstractGradSampleModule" for c in type(m).__mro__):
            where = f"`{name}` of the wrapped module" if name else "the wrapped module"
            raise TypeError(
                f"{where} is opacus' {type(m).__name__}: its per-sample gradients (p.grad_sample) cannot be "
                "computed by replicas, which each see a chunk of the batch (their rows would be summed onto the same "
                "rows, or lost on other devices' copies). Run it on one device, or across processes with opacus' "
                "DPDDP"
            )


def _refuse_scripted(root: nn.Module) -> None:
    """A TorchScript module keeps its parameters and submodules in the compiled module (its ``_parameters`` and
    ``_modules`` are views of it, not dicts): a copy cannot be given tensors of its own."""
    for name, m in root.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = f"`{name}` of the wrapped module" if name else "the wrapped module"
            raise TypeError(
                f"{where} is a TorchScript module ({type(m).__name__}), which cannot be copied into replicas: its "
                "parameters live in the compiled module. Wrap the eager module instead, "
                "dpfast.DataParallel(model, ...) before torch.jit.script or torch.jit.trace, or run the TorchScript "
                "module on one device (device_ids=[0]: it is called directly, as torch's DataParallel calls it)"
            )


def refuse_unreplicable(root: nn.Module) -> None:
    """Raise for a module tree whose replicas cannot be made (a TorchScript or compiled module, opacus' per-sample
    gradients): what the constructor, ``plan()`` and the call raise alike, before anything is changed."""
    _refuse_scripted(root)
    _refuse_compiled(root)
    _refuse_per_sample_gradients(root)


class SourceSnapshot:
    """The module tree as its replicas were built from it: every module, parameter and buffer, and a shallow
    snapshot of each module's class and dicts, to tell by identity whether it is still the same tree."""

    def __init__(self, root: nn.Module):
        refuse_unreplicable(root)
        self.root = root
        self.modules = list(root.modules())
        self.types = [type(m) for m in self.modules]
        # every module's __dict__, then its _parameters, _buffers and _modules: while a __dict__ holds its very
        # values, these are the dicts it holds
        self.own_dicts = [d for m in self.modules for d in (m._parameters, m._buffers, m._modules)]
        snaps = [snap(m.__dict__) for m in self.modules] + [snap(d) for d in self.own_dicts]
        self.keys, self.values = [k for k, _ in snaps], [v for _, v in snaps]
        n = len(self.modules)
        self.dict_keys, self.dict_values = self.keys[:n], self.values[:n]  # the modules' __dict__s alone
        self._tensors: list[torch.Tensor] | None = None
        self.index = {id(m): i for i, m in enumerate(self.modules)}
        self.params = list(root.parameters())  # deduplicated: a tied parameter is broadcast once, as in torch
        self.param_index = {id(p): k for k, p in enumerate(self.params)}
        self.buffers = list(root.buffers())
        self.params_and_buffers = self.params + self.buffers
        self.buffer_index = {id(b): k for k, b in enumerate(self.buffers)}
        names: dict[int, str] = {}
        for name, m in root.named_modules():
            names.setdefault(id(m), name)
        self.names = [names.get(id(m), "?") for m in self.modules]

    def valid(self, root: nn.Module) -> bool:
        """Whether ``root`` is still this tree: the same modules, each with the same class and the very same
        attributes, parameters, buffers and submodules (see :mod:`dpfast.run.replicas`)."""
        modules = self.modules
        return (
            modules[0] is root
            and all(map(operator.is_, map(type, modules), self.types))  # a __class__ swap leaves the dicts as they were
            and all_same([m.__dict__ for m in modules] + self.own_dicts, self.keys, self.values)
        )

    def tensors(self) -> list[torch.Tensor]:
        """:func:`tensors_of` the tree, as they are while it is :meth:`valid`."""
        if self._tensors is None:
            self._tensors = tensors_of(self.modules)
        return self._tensors


def tensors_of(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters, buffers and tensor attributes of ``modules``, module by module."""
    out = []
    for m in modules:
        attrs = (v for v in m.__dict__.values() if isinstance(v, torch.Tensor))
        out.extend(t for t in itertools.chain(m._parameters.values(), m._buffers.values(), attrs) if t is not None)
    return out


class Replica:
    """One copy of a :class:`SourceSnapshot` for one device slot: a module per source module (sharing its attributes,
    with children, bound methods and hooks moved to the copy), the slots each call writes tensors into, and a
    snapshot of each copy's dicts to undo what a forward changed."""

    def __init__(self, snapshot: SourceSnapshot):
        modules = snapshot.modules
        copies = [m._replicate_for_data_parallel() for m in modules]
        self.modules = copies
        self.root = copies[0]
        replica_of = {id(m): r for m, r in zip(modules, copies)}
        # slots: (replica module, attribute, tensor index, index in an RNN's _flat_weights or -1)
        self.param_slots: list[tuple[nn.Module, str, int, int]] = []
        self.buffer_slots: list[tuple[nn.Module, str, int]] = []
        for m, r in zip(modules, copies):
            r._former_parameters = OrderedDict()  # as torch's replicate (DDP reads it)
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else replica_of[id(child)]
            names = r.__dict__.get("_flat_weights_names")  # an RNN tracks its weights in _flat_weights too
            for key, p in m._parameters.items():
                r._parameters[key] = None
                if p is not None:
                    flat = names.index(key) if isinstance(names, list) and key in names else -1
                    self.param_slots.append((r, key, snapshot.param_index[id(p)], flat))
            for key, b in m._buffers.items():
                if b is not None:
                    self.buffer_slots.append((r, key, snapshot.buffer_index[id(b)]))
            for key, v in list(r.__dict__.items()):
                if key not in _OWN_DICTS:
                    new = rebind(v, replica_of)
                    if new is not v:
                        r.__dict__[key] = new
        self._replica_of = replica_of
        # Each replica gets hook dicts of its own, copied from the module's (with bound methods rebound): a forward
        # that registers hooks (HF models install their output-capturing hooks on first use) must not add them to
        # the module's own.
        self._hook_pairs: list[tuple[dict, dict]] = []  # (the copy's hook dict, the module's), kept in step
        for r, m in zip(copies, modules):
            for name in HOOK_DICTS:
                if name in m.__dict__:
                    theirs = m.__dict__[name]
                    r.__dict__[name] = mine = OrderedDict((k, rebind(h, replica_of)) for k, h in theirs.items())
                    self._hook_pairs.append((mine, theirs))
        self._hook_dicts = [d for pair in self._hook_pairs for d in pair]  # all of them, for the empty test
        self.holds_tensors = False  # a call's tensors are in the slots
        self.dirty = False  # written for a call since the last undo (its forward may have changed the copies)
        # each copy's __dict__, _parameters, _buffers and _modules, and what they held when built
        self._live = [d for r in copies for d in (r.__dict__, r._parameters, r._buffers, r._modules)]
        self._pristine = [dict(d) for d in self._live]  # what an undo restores: the dicts as built

    def write(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """This call's parameters (the module's own, or a copy) and buffers (this replica's own) into the slots."""
        if self.dirty:  # (a set's refresh undoes all its replicas in one call first)
            undo_all([self])
        self.sync_hooks()
        self._write_params(params)
        for r, key, k in self.buffer_slots:
            r._buffers[key] = buffers[k]
        self.holds_tensors = True
        self.dirty = True

    def _write_params(self, params: list[torch.Tensor]) -> None:
        """``params`` into the parameter slots: ``_parameters``, an RNN's ``_flat_weights`` and
        ``_former_parameters`` (as torch's ``replicate`` sets it)."""
        for r, key, k, flat in self.param_slots:
            t = params[k]
            # written into _parameters directly, so that code reading a replica's parameters (named_parameters(),
            # functional_call, a dtype or device probe) sees them as on the module, and no registration hook fires
            r._parameters[key] = t
            if flat >= 0:
                r.__dict__["_flat_weights"][flat] = t
            r._former_parameters[key] = t

    def clear(self) -> None:
        """Drop the tensors of the last call that wrote them (memory, and the autograd graph they belong to)."""
        self.undo()
        if not self.holds_tensors:
            return
        for r, key, _, flat in self.param_slots:
            r._parameters[key] = None
            if flat >= 0:
                r.__dict__["_flat_weights"][flat] = None
            r._former_parameters.pop(key, None)
        for r, key, _ in self.buffer_slots:
            r._buffers[key] = None
        self.holds_tensors = False

    def undo(self) -> None:
        """Attributes, submodules, buffers or hooks a forward set: back to the module's."""
        undo_all([self])

    def sync_hooks(self) -> None:
        """The module's hooks as they are now (the same hook ids in the same order), rebound to this replica. (The
        dicts are the same objects while the snapshot is valid: a module's hook dicts are never replaced.)"""
        if not any(self._hook_dicts):  # no hook on either side (the usual case): in step, in one pass in C
            return
        for mine, theirs in self._hook_pairs:
            if (mine or theirs) and (len(mine) != len(theirs) or any(map(operator.ne, mine, theirs))):
                mine.clear()
                mine.update((k, rebind(h, self._replica_of)) for k, h in theirs.items())


DICT_OF = operator.attrgetter("__dict__")  # (map(DICT_OF, modules): a module's __dict__ each, in C)


def undo_all(replicas: list[Replica]) -> None:
    """:meth:`Replica.undo` of every replica, in one restore. (Restoring every copy is cheaper than checking which
    ones changed.)"""
    live, pristine = [], []
    for replica in replicas:
        if replica.dirty:
            own = replica._live
            own[::4] = map(DICT_OF, replica.modules)  # (a __dict__ can be replaced; the other three are in it)
            live += own
            pristine += replica._pristine
    if live:
        restore(live, pristine)
        for replica in replicas:
            replica.dirty = False
