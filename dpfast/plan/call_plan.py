"""The planning stage: one function, :func:`plan_call`, turns (specs, a call's arguments, devices, weights) into a
:class:`CallPlan`. ``DataParallel.forward`` executes it, ``DataParallel.plan()`` prints it, and
``dpfast.distributed`` takes a rank's share of it, so what a call does and what its plan says cannot drift apart.
Every error about a call's arguments is raised here, before anything is copied or run.

A call is walked once for its key and planned by its :class:`~dpfast.plan.program.CallProgram` (compiled, with
every check, at the key's first call): per call only the sizes along the batch axes are read, and checked to agree
(:mod:`dpfast.plan.call_checks` says how ``B`` is chosen when they do not).

With ``cost`` (a :class:`~dpfast.plan.costs.CostSource`) the per-device sizes minimize the largest device cost instead
of evening out counts (:func:`~dpfast.plan.splits.balanced_split`); the costs are read and checked once ``B`` is known.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Callable

import torch

from ..trees.binding import Binding, BoundArguments
from ..trees.specs import Leaf
from .call_checks import choose_batch
from .costs import Balance, CostSource
from .program import program_for
from .render import plan_text
from .splits import balanced_split, split_sizes


@dataclasses.dataclass(eq=False)
class CallPlan:
    """What one call does, as ``DataParallel.plan()`` returns it: the very plan the call executes.

    ``str(plan)`` is a table of every argument leaf with its shape, spec and per-replica chunk (with ``cost``, each
    device's cost too); nothing is copied to build it.

    Attributes:
        mode: ``"split"`` (``B`` split over the devices), ``"once"`` (``B == 0`` or nothing to split: one call on
            the first device; ``reason`` says which), ``"direct"`` (one device: the module is called directly,
            like torch) or ``"passthrough"`` (no devices and no CUDA: the module is called directly).
        tree: the call's arguments bound to ``forward``'s parameters and walked, one record per leaf (internal).
        mapped: the records of the leaves that are split, in call order (internal).
        batch_size: ``B``, or ``None`` when no tensor is mapped to a batch axis.
        sizes: the chunk size per device (or rank), 0 for one that gets nothing; ``[]`` when nothing is split.
        devices: every ``device_ids`` entry, as ``torch.device`` (``[]`` for ranks).
        output_device: where the outputs are gathered.
        reason: why nothing is split (``"B = 0"``, ``"one device"``...), else ``""``.
        balance: with ``cost``, each device's cost for ``sizes`` and for the count split (else ``None``).
    """

    mode: str
    tree: BoundArguments  # the call's arguments, bound and walked (its Leaf records made when asked for)
    mapped: list[Leaf]  # those of tree.leaves that are split (leaf.split is set), in order (made when asked for)
    batch_size: int | None
    sizes: list[int]  # per device (or rank), 0 for one that gets nothing; [] when nothing is split
    devices: list[torch.device]  # every device_ids entry ([] for ranks)
    output_device: torch.device | None = None
    reason: str = ""
    balance: Balance | None = None

    @property
    def replicas(self) -> list[tuple[int, Any, int]]:
        """``(index, device, chunk size)`` of every replica that runs (those with rows), in device order."""
        if self.mode == "passthrough":
            return []
        first = self.devices[0] if self.devices else 0
        if self.mode != "split":
            return [(0, first, self.batch_size or 0)]
        return [(i, self.devices[i] if self.devices else i, s) for i, s in enumerate(self.sizes) if s > 0]

    def share(self, part: int) -> tuple[int, int]:
        """The rows of the batch that device (or rank) ``part`` gets.

        Args:
            part: the device's (or rank's) index in ``devices``.

        Returns:
            ``(start, stop)``: rows ``start:stop`` of the batch (``start == stop`` for a part that gets none).

        Raises:
            IndexError: ``part`` is not an index of ``sizes`` (a plan that splits nothing has none).
        """
        start = sum(self.sizes[:part])
        return start, start + self.sizes[part]

    def __str__(self) -> str:
        return plan_text(self)

    __repr__ = __str__


def plan_call(
    binding: Binding,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    parts: int,
    weights: Sequence[Fraction] | None = None,
    *,
    devices: Sequence[torch.device] = (),
    output_device: torch.device | None = None,
    cost: CostSource | None = None,
) -> CallPlan:
    """Bind the call, check its inputs and batch, and split ``B`` over ``parts`` devices (or ranks).

    With ``devices`` (``DataParallel``) the inputs' devices are checked against them, and a single device plans a
    direct call with nothing split, as ``torch.nn.DataParallel`` makes one. With ``cost`` the split balances the
    call's per-sample costs (read whenever there is a ``B``, so ``B == 0`` wants no costs). Raises ``ScatterError``
    and the spec and cost errors (``TypeError``/``ValueError`` naming the argument) before anything is copied.
    """
    devices = list(devices)
    tree = BoundArguments(binding, args, kwargs)
    program = program_for(tree, devices)
    if len(devices) == 1:  # nothing is split, so there is no batch to agree on: B is informative only
        batch = choose_batch(list(zip(program.args, program.sizes(tree.flat))))
        return CallPlan("direct", tree, None, batch, [], devices, output_device, "one device")
    batch = program.batch(tree, parts, weights)
    if batch is None:
        return CallPlan("once", tree, None, None, [], devices, output_device, "no tensor to split")
    sizes = list(_sizes(batch, parts, None if weights is None else tuple(weights)))
    balance = None
    if cost is not None:
        costs = cost.read(tree, batch)
        count, sizes = sizes, balanced_split(costs.prefix, parts, weights)
        balance = Balance(costs, cost.text, sizes, count, weights)
    if batch == 0:
        return CallPlan("once", tree, None, 0, sizes, devices, output_device, "B = 0")
    return CallPlan("split", tree, None, batch, sizes, devices, output_device, balance=balance)


def _mapped_leaves(plan: CallPlan) -> list[Leaf]:
    """The records of the leaves that are split, in call order (made when first asked for)."""
    mapped = plan.__dict__["_mapped"]
    if mapped is None:
        mapped = plan.__dict__["_mapped"] = [leaf for leaf in plan.tree.leaves if leaf.split is not None]
    return mapped


def _set_mapped(plan: CallPlan, mapped: list[Leaf] | None) -> None:
    plan.__dict__["_mapped"] = mapped


# the dataclass field `mapped` (its __init__, repr, fields()) read and written through this property
CallPlan.mapped = property(_mapped_leaves, _set_mapped)  # type: ignore[assignment]


@functools.lru_cache(maxsize=256)
def _sizes(batch: int, parts: int, weights: tuple[Fraction, ...] | None) -> tuple[int, ...]:
    """:func:`split_sizes`, remembered: a training loop splits the same ``B`` over the same parts every step."""
    return tuple(split_sizes(batch, parts, weights))


def passthrough_plan(forward: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> CallPlan:
    """The plan of a call that goes straight to the module (no device_ids, no CUDA): in_dims are ignored then, so
    the tree is bound without them and nothing here can raise what the call would not."""
    tree = BoundArguments(Binding(forward, None, 0), args, kwargs)
    return CallPlan("passthrough", tree, [], None, [], [], None, "no device_ids and no CUDA")
