"""One call program per call structure: what planning decides about every leaf of a call, decided once per key.

A call is walked once for its *key* (:class:`~dpfast.trees.binding.BoundArguments`: the arguments' structure and
each leaf's facts, by value: spec, kind, dtype, dims, layout, memory format, device type, ``requires_grad``). The
first call of a key is walked again with a record per leaf and planned in full, which raises whatever its
arguments get wrong; what that decides about each leaf is its :class:`CallProgram`: which leaves split and how
(along which axis, by sequence, by item), which are copied to every device, which pass by reference, and how the
split ones are grouped for one ``ops.scatter`` call each. Every later call of the key runs it: the sizes along the
batch axes are the only thing read per call. Every executor runs the same program: ``scatter`` onto devices
(``DataParallel``), taking a rank's rows (``DistributedDataParallel``, both input modes).

Nothing in a program holds a call's values or is keyed on an object's identity. Each wrapper keeps a few programs
(:class:`ProgramCache`, least recently used out first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..ext.loader import C
from ..trees.binding import BoundArguments
from ..trees.containers import packed_batch
from ..trees.facts import memory_order
from ..trees.specs import Leaf
from .call_checks import check_batch, check_input_devices, check_one_shot, map_leaves

_read_batch = getattr(C, "_batch_size", None) if C is not None else None  # (csrc/python_many.cpp)
PROGRAMS_KEPT = 32  # per wrapper: a workload of a few structures (train, eval, a last smaller batch) keeps them all


class ProgramCache:
    """Programs by key, the least recently used dropped past :data:`PROGRAMS_KEPT`. Calls from several threads may
    share a wrapper: each step is one dict operation (atomic), and a program another thread dropped meanwhile is
    merely compiled again."""

    def __init__(self, size: int = PROGRAMS_KEPT) -> None:
        self.size = size
        self._programs: OrderedDict[Any, Any] = OrderedDict()
        self.compiled = 0  # how many programs were compiled (tests read it)

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, key: Any) -> Any:
        programs = self._programs
        program = programs.get(key)
        if program is not None:
            try:  # noqa: SIM105 - (suppress() costs a call on every call)
                programs.move_to_end(key)
            except KeyError:  # (another thread dropped it just now)
                pass
        return program

    def put(self, key: Any, program: Any) -> None:
        programs = self._programs
        programs[key] = program
        while len(programs) > self.size:
            try:
                programs.popitem(last=False)
            except KeyError:
                break


def _off_axis(value: Tensor, axis: Any) -> tuple[int, int] | None:
    """``(ndim, axis)`` of a tensor split on an axis other than 0 (None otherwise, or when the axis is out of
    range: that call is refused)."""
    n = value.dim()
    if not isinstance(axis, int) or not -n <= axis < n or axis % n == 0:
        return None
    return n, axis % n


class CallProgram:
    """What planning decided about every leaf of the calls of one key.

    ``mapped``: the positions of the leaves that split (their batch axis ``axes[k]``, their kind ``kinds[k]``:
    ``"tensor"``, ``"packed"``, ``"items"``, ``"jagged"``, ``"quantized"``; their argument ``args[k]``).
    ``groups``: the plain tensors that split, by (axis, memory order, device type), each moved by one
    ``ops.scatter``; ``copied``: tensors and PackedSequences copied whole to every device; ``special``: the other
    splits, each moved by its own code. ``grad``: the tensors that require grad. ``off_axis``: ``(ndim, axis)`` of
    the tensors split on an axis other than 0."""

    __slots__ = ("splitting", "mapped", "axes", "kinds", "args", "groups", "copied", "special", "grad",
                 "all_one_group", "only_tensors", "n_leaves", "fingerprint", "off_axis")  # fmt: skip

    def __init__(self, tree: BoundArguments, devices: Sequence[torch.device]) -> None:
        leaves = tree.leaves  # the call walked again, a record per leaf
        if devices:
            check_input_devices(leaves, devices)
        if len(devices) > 1:  # (DataParallel's replicas share what is passed by reference; a rank has its own)
            check_one_shot(leaves)
        self.splitting = len(devices) != 1
        mapped = map_leaves(leaves, self.splitting)  # raises for what no call of this key can split
        self.n_leaves = len(leaves)
        self.mapped = [m.index for m in mapped]
        self.axes = [m.axis for m in mapped]
        self.kinds = [m.split for m in mapped]
        self.args = [m.arg for m in mapped]
        groups: dict[tuple, list[int]] = {}
        self.special: list[tuple[int, str, int | None]] = []
        for m in mapped:
            if m.split == "tensor":
                v = m.value
                groups.setdefault((m.axis, memory_order(v), v.device.type), []).append(m.index)
            else:
                self.special.append((m.index, m.split, m.axis))
        self.groups = list(groups.items())
        split = set(self.mapped)
        self.copied = [
            leaf.index
            for leaf in leaves
            if leaf.index not in split and isinstance(leaf.value, (Tensor, PackedSequence))
        ]
        self.grad = [leaf.index for leaf in leaves if isinstance(leaf.value, Tensor) and leaf.value.requires_grad]
        one = len(self.groups) == 1 and self.groups[0][0][1] is None and self.groups[0][0][2] == "cpu"
        self.all_one_group = one and len(self.groups[0][1]) == len(leaves)
        self.only_tensors = all(k == "tensor" for k in self.kinds) and None not in self.axes
        self.fingerprint: int | None = None  # what DDP's ranks compare of this key, made at its first step there
        # an output of that ndim whose axis also carries the chunk sizes may hold its batch there
        self.off_axis = frozenset(_off_axis(m.value, m.axis) for m in mapped if m.split == "tensor") - {None}

    def mark(self, leaves: list[Leaf]) -> None:
        """Planning's marks (how each leaf splits, its size there) on the records of a call of this key."""
        map_leaves(leaves, self.splitting)

    def sizes(self, flat: Sequence[Any]) -> list[int | None]:
        """The size of every mapped leaf along its batch axis, in this call (None for one without)."""
        if self.only_tensors:  # (the common case: plain tensors, each with its axis)
            return [flat[i].size(a) for i, a in zip(self.mapped, self.axes)]
        out: list = []
        for i, kind, axis in zip(self.mapped, self.kinds, self.axes):
            v = flat[i]
            if kind == "items":
                out.append(len(v))
            elif kind == "packed":
                out.append(packed_batch(v))
            else:
                out.append(None if axis is None else v.shape[axis])  # (None: it has no batch axis)
        return out

    def batch(self, tree: BoundArguments, parts: int, weights: Any) -> int | None:
        """``B`` of this call (None: nothing is mapped); raises :class:`~dpfast.ScatterError`, with its table,
        when the mapped leaves disagree (or one has no batch axis)."""
        if not self.mapped:
            return None
        if self.only_tensors and _read_batch is not None:  # (one call into the extension reads them all)
            batch = _read_batch(tree.flat, self.mapped, self.axes)
            if type(batch) is int:
                return batch
        sizes = self.sizes(tree.flat)
        if sizes[0] is not None and sizes.count(sizes[0]) == len(sizes):
            return sizes[0]
        return check_batch(tree, [leaf for leaf in tree.leaves if leaf.split is not None], parts, weights)


def program_for(tree: BoundArguments, devices: Sequence[torch.device]) -> CallProgram:
    """The program of ``tree``'s key on ``devices`` (compiled at the key's first call, which raises what its
    arguments get wrong; a call whose key cannot be compared by value is compiled every time)."""
    binding, key = tree.binding, tree.key
    cache = binding.programs
    if cache is None:
        cache = binding.programs = ProgramCache()
    if devices:  # (DataParallel's: what the inputs' devices are checked against, and whether anything splits)
        key = None if key is None else (key, devices[0].type, len(devices) == 1)
    program = cache.get(key) if key is not None else None
    if program is None:
        program = CallProgram(tree, devices)
        cache.compiled += 1
        if key is not None:
            cache.put(key, program)
    tree.program = program
    return program
