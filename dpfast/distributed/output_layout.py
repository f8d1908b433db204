"""What the output exchange of ``gather_outputs=True`` sends of one call's outputs, and where in the bytes.

:func:`sort_outputs` walks the outputs with ``out_dims`` (as every rank must, the same way) into an
:class:`OutputLayout` (what is fixed by the outputs' structure and their tensors' facts and shapes: each leaf's
fate, each tensor's kind, axis, shape, dtype and device, the description every rank must agree on and its
fingerprint) and this call's values. The wrapper keeps the layouts it made (:class:`ExchangeLayouts`) by the
outputs' key (:mod:`dpfast.trees.walk`) and their tensors' shapes: outputs seen before are walked once, for their
key, and sorted by their layout.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..plan.program import ProgramCache
from ..trees.containers import TreeDef
from ..trees.facts import leaf_facts
from ..trees.specs import Leaf, Spec
from ..trees.walk import walk
from .agreement import fingerprint

_PLACEMENTS = 64  # the most rows tuples a layout keeps the placement of
ALIGN = 16  # every piece of a payload starts at a multiple of this many bytes (any dtype's view is aligned)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass
class Placement:
    """Where a payload puts its pieces: the rows of each "cat" tensor (int64) at 0, then each tensor's bytes at
    ``offsets[i]`` (``nbytes[i]`` long, shaped ``shapes[i]``: a "cat" tensor's rows along axis 0); ``size`` in all."""

    offsets: list[int]
    nbytes: list[int]
    shapes: list[tuple]
    size: int


@dataclasses.dataclass
class OutputLayout:
    """What the exchange needs of outputs of one structure and one set of tensor facts (see the module docstring).
    Per leaf ``slots``: ``("keep",)`` (this rank's value stays) or ``("t", index, number type)``; per tensor its
    kind (``"cat"`` | ``"red"``), reduction (``"sum"`` | ``"mean"`` | ``""``), axis, local shape, dtype, device."""

    slots: list[tuple] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)
    reductions: list[str] = dataclasses.field(default_factory=list)
    axes: list[int] = dataclasses.field(default_factory=list)
    shapes: list[tuple] = dataclasses.field(default_factory=list)
    dtypes: list[torch.dtype] = dataclasses.field(default_factory=list)
    devices: list[torch.device] = dataclasses.field(default_factory=list)
    desc: list[Any] = dataclasses.field(default_factory=list)  # what every rank must agree on
    fp: int = 0
    n_cat: int = 0
    tensor_leaves: list[int] = dataclasses.field(default_factory=list)  # per tensor: its leaf's position
    spatial: list[int] = dataclasses.field(default_factory=list)  # the tensors of 4 or 5 dims (may be channels_last)
    _placements: dict = dataclasses.field(default_factory=dict)
    _grad_groups: list[list[int]] | None = None

    def grad_groups(self) -> list[list[int]]:
        """The tensors that take gradients (floating point and complex ones), grouped by dtype (worked out once)."""
        if self._grad_groups is None:
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, dtype in enumerate(self.dtypes):
                if dtype.is_floating_point or dtype.is_complex:
                    by_dtype.setdefault(dtype, []).append(i)
            self._grad_groups = list(by_dtype.values())
        return self._grad_groups

    def placement(self, rows: tuple[int, ...]) -> Placement:
        """Where a payload whose "cat" tensors have ``rows`` rows each puts its pieces (worked out once per rows)."""
        got = self._placements.get(rows)
        if got is None:
            if len(self._placements) >= _PLACEMENTS:  # the ranks' rows change from call to call: keep a few
                self._placements.clear()
            got = self._placements[rows] = self._place(rows)
        return got

    def _place(self, rows: tuple[int, ...]) -> Placement:
        offset, it = aligned(8 * len(rows)), iter(rows)
        offsets, nbytes, shapes = [], [], []
        for kind, shape, axis, dtype in zip(self.kinds, self.shapes, self.axes, self.dtypes):
            if kind == "cat":
                shape = (next(it),) + row_shape(shape, axis)
            n = dtype.itemsize * math.prod(shape)
            offsets.append(offset)
            nbytes.append(n)
            shapes.append(shape)
            offset += aligned(n)
        return Placement(offsets, nbytes, shapes, offset)

    def own_rows(self, active: bool) -> tuple[int, ...]:
        """The rows this rank sends of each "cat" tensor (none when its outputs do not count)."""
        if not active:
            return (0,) * self.n_cat
        return tuple(1 if not s else s[a] for k, s, a in zip(self.kinds, self.shapes, self.axes) if k == "cat")


@dataclasses.dataclass
class SortedOutputs:
    """One call's outputs sorted by a layout: the tree to rebuild, its leaves' values, and its tensors."""

    layout: OutputLayout
    tdef: TreeDef | None
    values: list[Any]
    tensors: list[Tensor]


def sort_outputs(out: Any, spec: Spec, dim: int, explicit: bool) -> SortedOutputs:
    """``out`` walked with ``spec`` (with a record per leaf, and every check) and sorted for the exchange. Raises
    TypeError/ValueError naming the output."""
    leaves: list[Leaf] = []
    tdef, values, _ = walk(out, spec, "output", dim, explicit, "out_dims", leaves)
    layout, tensors = OutputLayout(), []
    for leaf in leaves:
        v, s = leaf.value, leaf.spec
        if v is None or s is None:
            layout.desc.append((leaf.path, "keep", repr(s), v is None))
            layout.slots.append(("keep",))
        elif s == "items":
            raise TypeError(
                f"output `{leaf.path}` has out_dims 'items', which gather_outputs cannot all-gather yet; give it "
                "out_dims None to keep this rank's own items"
            )
        elif isinstance(s, str):
            _reduced_leaf(layout, tensors, leaf)
        else:
            _concatenated_leaf(layout, tensors, leaf)
    layout.fp = fingerprint(layout.desc)
    layout.n_cat = layout.kinds.count("cat")
    layout.tensor_leaves = [i for i, slot in enumerate(layout.slots) if slot[0] == "t"]
    layout.spatial = [i for i, shape in enumerate(layout.shapes) if len(shape) in (4, 5)]
    return SortedOutputs(layout, tdef, values, tensors)


def _reduced_leaf(layout: OutputLayout, tensors: list, leaf: Leaf) -> None:
    """Sorts a leaf under "sum"/"mean" (a Python number is sent as a tensor: int64 for an int under "sum")."""
    v, s = leaf.value, leaf.spec
    if isinstance(v, Tensor):
        t, num = v, None
    elif isinstance(v, numbers.Number) and not isinstance(v, bool):
        num = type(v) if s == "sum" and isinstance(v, int) else float
        t = _number_tensor(v, num)
        if t is None:
            held = "int64" if num is int else "float64"
            raise ValueError(
                f"output `{leaf.path}` is {v!r}, which {held} cannot hold: out_dims {s!r} gathers a Python number "
                "as int64 (an int under 'sum') or float64; return it as a tensor of the dtype it needs"
            )
    else:
        raise TypeError(
            f"output `{leaf.path}` is a {type(v).__name__}; out_dims {s!r} needs tensors or numbers from every rank"
        )
    layout.desc.append((leaf.path, s, tuple(t.shape), str(t.dtype)))
    _add(layout, tensors, t, num, "red", s, 0)


def _number_tensor(v: Any, num: type) -> Tensor | None:
    """A Python number as the tensor the exchange sends (None: int64 or float64 cannot hold it)."""
    try:
        return torch.tensor(v, dtype=torch.int64 if num is int else torch.float64)
    except (RuntimeError, OverflowError, TypeError, ValueError):  # an int past int64, a complex number
        return None


def _concatenated_leaf(layout: OutputLayout, tensors: list, leaf: Leaf) -> None:
    v, s = leaf.value, leaf.spec
    if isinstance(v, PackedSequence):
        raise TypeError(
            f"output `{leaf.path}` is a PackedSequence, which gather_outputs cannot all-gather yet; return it padded "
            "(torch.nn.utils.rnn.pad_packed_sequence), or give it out_dims None to keep this rank's own value"
        )
    if not isinstance(v, Tensor):
        raise TypeError(
            f"output `{leaf.path}` is a {type(v).__name__}, which cannot be concatenated along axis {s}; give it "
            "out_dims None (this rank's value), 'sum' or 'mean'"
        )
    if v.dim() and not -v.dim() <= s < v.dim():
        raise ValueError(
            f"output `{leaf.path}` has shape {tuple(v.shape)}: axis {s} is out of range; give it another out_dims "
            "axis, or None/'sum'/'mean'"
        )
    axis = s % v.dim() if v.dim() else 0
    layout.desc.append((leaf.path, "cat", axis, v.dim(), str(v.dtype), row_shape(tuple(v.shape), axis)))
    _add(layout, tensors, v, None, "cat", "", axis)


def _add(layout: OutputLayout, tensors: list, t: Tensor, num: Any, kind: str, reduction: str, axis: int) -> None:
    layout.slots.append(("t", len(tensors), num))
    tensors.append(t)
    layout.kinds.append(kind)
    layout.reductions.append(reduction)
    layout.axes.append(axis)
    layout.shapes.append(tuple(t.shape))
    layout.dtypes.append(t.dtype)
    layout.devices.append(t.device)


class ExchangeLayouts:
    """What one wrapper's output exchange keeps from call to call: the bytes its first all-gather carries (the
    ``capacity`` every rank computed from the last exchange's headers) and the layouts of the outputs it sorted,
    by their key and their tensors' shapes (:mod:`dpfast.trees.walk`), under the ``out_dims`` they were sorted by
    (a copy: a spec edited in place is another spec, and starts afresh)."""

    __slots__ = ("capacity", "spec", "layouts")

    def __init__(self) -> None:
        self.capacity = 0
        self.spec: tuple | None = None  # (out_dims, dim, explicit) the layouts were sorted under
        self.layouts = ProgramCache()

    def sort(self, out: Any, spec: Spec, dim: int, explicit: bool) -> SortedOutputs:
        """``out`` sorted for the exchange (by the layout of its key and shapes, made at their first call)."""
        if self.spec != (spec, dim, explicit):
            self.spec, self.layouts = copy.deepcopy((spec, dim, explicit)), ProgramCache()
        tdef, values, key = walk(out, spec, "output", dim, explicit, "out_dims", None)
        if key is not None:
            key = (key, leaf_facts(values), tuple(v.shape if isinstance(v, Tensor) else None for v in values))
            layout = self.layouts.get(key)
            if layout is not None:
                got = _sorted_by(layout, tdef, values)
                if got is not None:
                    return got
        got = sort_outputs(out, spec, dim, explicit)
        if key is not None:
            self.layouts.put(key, got.layout)
        return got


def _sorted_by(layout: OutputLayout, tdef: TreeDef, values: list) -> SortedOutputs | None:
    """Outputs of the key and shapes ``layout`` was made for, sorted by it (None: a number it cannot send)."""
    tensors = []
    for i in layout.tensor_leaves:
        num = layout.slots[i][2]
        t = values[i] if num is None else _number_tensor(values[i], num)
        if t is None:
            return None
        tensors.append(t)
    return SortedOutputs(layout, tdef, values, tensors)


def row_shape(shape: tuple, axis: int) -> tuple:
    """A "cat" tensor's shape without its gathered axis (a 0-dim tensor gathers as one row of shape ())."""
    return tuple(n for k, n in enumerate(shape) if k != axis) if shape else ()
