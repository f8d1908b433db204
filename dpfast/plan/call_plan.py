"""The planning stage: one function, :func:`plan_call`, turns (specs, a call's arguments, devices, weights) into a
:class:`CallPlan`. ``DataParallel.forward`` executes it, ``DataParallel.plan()`` prints it, and
``dpfast.distributed`` takes a rank's share of it, so what a call does and what its plan says cannot drift apart.
Every error about a call's arguments is raised here, before anything is copied or run.

How ``B`` is chosen when the mapped tensors disagree: every top-level argument votes with the size of its first
mapped tensor along its batch axis; the size with most votes wins and ties go to the earliest argument (in call
order: positional, then keyword). So ``f(x, h)`` with ``x`` ``(B, T, F)`` and an LSTM state ``h = (h0, c0)`` of
``(L, B, H)`` under the default ``dim=0`` reads ``B`` from ``x`` and reports ``h[0]`` and ``h[1]`` as the mismatch,
with ``in_dims={'h': 1}`` as the fix.

With ``cost`` (a :class:`~dpfast.plan.costs.CostSource`) the per-device sizes minimize the largest device cost instead
of evening out counts (:func:`~dpfast.plan.splits.balanced_split`); the costs are read and checked once ``B`` is known.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from .. import ops
from ..trees.binding import Binding, BoundArguments, CallSkeleton
from ..trees.containers import packed_batch
from ..trees.specs import ITEMS, Leaf
from .batch_errors import scatter_message
from .costs import Balance, CostSource
from .errors import ScatterError
from .layouts import split_method
from .render import plan_text
from .splits import balanced_split, split_sizes


def map_leaves(tree: BoundArguments, splitting: bool = True) -> list[Leaf]:
    """The leaves to split, each marked with how (``leaf.split``) and along which axis, with its batch size (or
    the problem that leaves it without one). A non-tensor under an explicit int spec is an error (under the
    default it is passed by reference, as torch does), and so is a tensor that cannot be split (a sparse one, a
    strided nested one), unless nothing is (one device)."""
    out = []
    for leaf in tree.leaves:
        v, spec = leaf.value, leaf.spec
        if spec is None or v is None:
            continue
        if spec == ITEMS:
            leaf.split, leaf.size = "items", len(v)
        elif isinstance(v, Tensor):
            method, problem = split_method(leaf)
            if problem is not None:
                if splitting:
                    raise ValueError(problem)
                continue
            leaf.split = method
            _batch_axis(leaf, v, spec)
        elif isinstance(v, PackedSequence):
            leaf.split, leaf.size = "packed", packed_batch(v)
        elif leaf.explicit:
            raise TypeError(
                f"in_dims gives `{leaf.path}` the batch axis {spec}, but it is {_a(type(v).__name__)}, not a tensor; "
                "pass it as a tensor (e.g. torch.tensor(...)) to split it, or give it the spec None to pass it "
                "unchanged to every replica"
            )
        else:
            continue
        out.append(leaf)
    return out


def _batch_axis(leaf: Leaf, t: Tensor, spec: int) -> None:
    nd = t.dim()
    if nd == 0:
        leaf.problem = "0-dim tensor has no batch axis"
    elif not -nd <= spec < nd:
        leaf.problem = f"axis {spec} out of range for {nd} dims"
    else:
        leaf.axis = spec % nd
        leaf.size = t.shape[leaf.axis]


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def choose_batch(mapped: Sequence[Leaf]) -> int | None:
    votes: dict[int, int] = {}
    for m in mapped:
        if m.size is not None and m.arg not in votes:
            votes[m.arg] = m.size
    if not votes:
        return None
    counts = Counter(votes.values())
    first = {}
    for arg in sorted(votes):
        first.setdefault(votes[arg], arg)
    return max(counts, key=lambda s: (counts[s], -first[s]))


def check_batch(
    tree: BoundArguments, mapped: Sequence[Leaf], parts: int, weights: Sequence[Fraction] | None
) -> int | None:
    """``B``, or ``None`` when nothing is mapped; raises :class:`ScatterError` on any disagreement."""
    batch = choose_batch(mapped)
    bad = [m for m in mapped if m.problem is not None or m.size != batch]
    if not bad:
        return batch
    chunk = min((s for s in split_sizes(batch, parts, weights) if s > 0), default=0) if batch else 0
    raise ScatterError(scatter_message(tree, mapped, bad, batch, chunk))


def check_input_devices(tree: BoundArguments, devices: Sequence[torch.device]) -> None:
    """Inputs may live on the CPU or on devices of device_ids' type (they are moved); anything else (a meta
    tensor, a CUDA tensor in a CPU rehearsal) is refused before anything is copied."""
    kind = devices[0].type
    for leaf in tree.leaves:
        v = leaf.value
        if isinstance(v, Tensor):
            if v.is_cpu or (v.is_cuda and kind == "cuda"):  # no device object to build: the common cases
                continue
            dev = v.device
        elif isinstance(v, PackedSequence):
            dev = v.data.device
        else:
            continue
        if dev.type != "cpu" and dev.type != kind:
            where = "the CPU" if kind == "cpu" else f"the CPU or a {kind} device"
            raise ValueError(
                f"`{leaf.path}` is on {dev}, but device_ids are "
                f"[{', '.join(repr(str(d)) for d in devices[:8])}{', ...' if len(devices) > 8 else ''}]; inputs must "
                f"be on {where}: move it with .to({str(devices[0])!r}) first"
            )


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
    tree: BoundArguments  # the call's arguments, bound and walked: one Leaf per leaf
    mapped: list[Leaf]  # those of tree.leaves that are split (leaf.split is set), in order (see _mapped_leaves)
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
    kept = False  # whether the call has the kept skeleton's structure (only its values sent it down the full walk)
    if cost is None and len(devices) != 1 and binding.skeleton is not None:
        plan = _plan_again(binding, args, kwargs, parts, weights, devices, output_device)
        if type(plan) is CallPlan:
            return plan
        kept = plan
    tree = BoundArguments(binding, args, kwargs)
    if devices:
        check_input_devices(tree, devices)
    mapped = map_leaves(tree, splitting=len(devices) != 1)
    if len(devices) == 1:  # nothing is split, so there is no batch to agree on: B is informative only
        return CallPlan("direct", tree, mapped, choose_batch(mapped), [], devices, output_device, "one device")
    batch = check_batch(tree, mapped, parts, weights)
    if batch is None:
        return CallPlan("once", tree, mapped, None, [], devices, output_device, "no tensor to split")
    sizes = split_sizes(batch, parts, weights)
    balance = None
    if cost is not None:
        costs = cost.read(tree, batch)
        count, sizes = sizes, balanced_split(costs.prefix, parts, weights)
        balance = Balance(costs, cost.text, sizes, count, weights)
    if batch == 0:
        return CallPlan("once", tree, mapped, 0, sizes, devices, output_device, "B = 0")
    if cost is None and not kept:  # (a kept skeleton of this very structure stays: the same one would be made)
        _remember(binding, tree)
    return CallPlan("split", tree, mapped, batch, sizes, devices, output_device, balance=balance)


def _mapped_leaves(plan: CallPlan) -> list[Leaf]:
    """The records of the leaves that are split, in call order (internal); a plan read along the last call's
    skeleton is given None, and makes them (and its tree's Leaf records) only when asked for."""
    mapped = plan.__dict__["_mapped"]
    if mapped is None:
        mapped = plan.__dict__["_mapped"] = [leaf for leaf in plan.tree.leaves if leaf.split is not None]
    return mapped


def _set_mapped(plan: CallPlan, mapped: list[Leaf] | None) -> None:
    plan.__dict__["_mapped"] = mapped


# the dataclass field `mapped` (its __init__, repr, fields()) read and written through this property
CallPlan.mapped = property(_mapped_leaves, _set_mapped)  # type: ignore[assignment]


def _remember(binding: Binding, tree: BoundArguments) -> None:
    """Keep the structure of a call that split for the next one (only once it is seen twice in a row: a workload
    whose structure changes every call never pays for a skeleton)."""
    signature = (tree.n_args, tree.kw_keys, len(tree.leaves))
    if binding.last_signature == signature:
        binding.skeleton = CallSkeleton.of(tree)
    binding.last_signature = signature


def _plan_again(
    binding: Binding,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    parts: int,
    weights: Sequence[Fraction] | None,
    devices: list[torch.device],
    output_device: torch.device | None,
) -> CallPlan | bool:
    """The plan of a call whose arguments have the structure of the last call that split (the binding's skeleton),
    when every tensor is a plain dense one on an allowed device and those to split agree on ``B > 0``: what the
    full walk below plans for it, without walking specs or making a record per leaf. Else whether the call has the
    skeleton's structure (its values are what the full walk must look at), and the full walk plans the call (and
    raises what is wrong)."""
    skeleton = binding.skeleton
    tree = BoundArguments.again(binding, skeleton, args, kwargs) if skeleton is not None else None
    if tree is None:
        return False
    tensors = skeleton.tensor_values(tree.flat)
    facts = ops._plain_batch(tensors, skeleton.specs, not devices or devices[0].type == "cuda")
    if facts is None or facts[0] <= 0:
        return True
    batch, axes, _ = facts
    tree.mark_split(axes, batch)
    sizes = _kept_sizes(batch, parts, None if weights is None else tuple(weights))
    return CallPlan("split", tree, None, batch, list(sizes), devices, output_device)


@functools.lru_cache(maxsize=256)
def _kept_sizes(batch: int, parts: int, weights: tuple[Fraction, ...] | None) -> tuple[int, ...]:
    """:func:`split_sizes`, remembered: a training loop splits the same ``B`` over the same parts every step."""
    return tuple(split_sizes(batch, parts, weights))


def passthrough_plan(forward: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> CallPlan:
    """The plan of a call that goes straight to the module (no device_ids, no CUDA): in_dims are ignored then, so
    the tree is bound without them and nothing here can raise what the call would not."""
    tree = BoundArguments(Binding(forward, None, 0), args, kwargs)
    return CallPlan("passthrough", tree, [], None, [], [], None, "no device_ids and no CUDA")
