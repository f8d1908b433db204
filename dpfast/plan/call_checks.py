"""The checks planning makes of a call's leaves: which leaves split and along which axis (:func:`map_leaves`), that
the inputs are on devices the call can use (:func:`check_input_devices`), and that the mapped leaves agree on the
batch size ``B`` (:func:`check_batch`, which raises :class:`~dpfast.ScatterError` with its table).

How ``B`` is chosen when the mapped tensors disagree: every top-level argument votes with the size of its first
mapped tensor along its batch axis; the size with most votes wins and ties go to the earliest argument (in call
order: positional, then keyword). So ``f(x, h)`` with ``x`` ``(B, T, F)`` and an LSTM state ``h = (h0, c0)`` of
``(L, B, H)`` under the default ``dim=0`` reads ``B`` from ``x`` and reports ``h[0]`` and ``h[1]`` as the mismatch,
with ``in_dims={'h': 1}`` as the fix.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.binding import BoundArguments
from ..trees.containers import packed_batch
from ..trees.specs import ITEMS, Leaf
from .batch_errors import scatter_message
from .errors import ScatterError
from .layouts import split_method


def map_leaves(leaves: Sequence[Leaf], splitting: bool = True) -> list[Leaf]:
    """The leaves to split, each marked with how (``leaf.split``) and along which axis, with its batch size (or
    the problem that leaves it without one). A non-tensor under an explicit int spec is an error (under the
    default it is passed by reference, as torch does), and so is a tensor that cannot be split (a sparse one, a
    strided nested one), unless nothing is (one device)."""
    out = []
    for leaf in leaves:
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


def choose_batch(sizes: Sequence[tuple[int, int | None]]) -> int | None:
    """``B`` by the arguments' votes: ``sizes`` holds ``(argument, size)`` of every mapped leaf, in call order."""
    votes: dict[int, int] = {}
    for arg, size in sizes:
        if size is not None and arg not in votes:
            votes[arg] = size
    if not votes:
        return None
    counts = Counter(votes.values())
    first = {}
    for arg in sorted(votes):
        first.setdefault(votes[arg], arg)
    return max(counts, key=lambda s: (counts[s], -first[s]))


def check_batch(tree: Any, mapped: Sequence[Leaf], parts: int, weights: Sequence[Fraction] | None) -> int | None:
    """``B``, or ``None`` when nothing is mapped; raises :class:`ScatterError` on any disagreement."""
    batch = choose_batch([(m.arg, m.size) for m in mapped])
    if all(m.problem is None and m.size == batch for m in mapped):
        return batch
    raise ScatterError(scatter_message(tree, mapped, batch, parts, weights, functools.partial(_splits_into, tree)))


def _splits_into(tree: Any, fixes: dict, batch: int) -> bool:
    """Whether ``tree``'s call, with ``fixes`` applied to its in_dims, maps every leaf it splits to ``B == batch``:
    a suggested fix is offered only so."""
    dim, in_dims = tree.binding.suggested(fixes)
    try:
        again = BoundArguments(tree.binding.rebound(in_dims, dim), tree.args, tree.kwargs)
        mapped = map_leaves(again.leaves)
    except (TypeError, ValueError):
        return False
    return bool(mapped) and all(m.problem is None and m.size == batch for m in mapped)


def check_one_shot(leaves: Sequence[Leaf]) -> None:
    """A one-shot iterator (a generator, ``iter(...)``, ``map(...)``) cannot go to several replicas: each would be
    handed the same object, so the first would use it up and the others would find it empty. Refused whatever its
    spec, before anything runs."""
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, Iterator) and not isinstance(v, Tensor):
            raise TypeError(
                f"`{leaf.path}` is {_a(type(v).__name__)}, a one-shot iterator: every replica would be handed the same "
                "one, so the first would use it up and the others would find it empty. Pass a list or tuple instead "
                "(list(...): every replica gets all of it), or a tensor to split along the batch axis; a list of "
                "per-sample items is split by position under the spec 'items'"
            )


def check_input_devices(leaves: Sequence[Leaf], devices: Sequence[torch.device]) -> None:
    """Inputs may live on the CPU or on devices of device_ids' type (they are moved); anything else (a meta
    tensor, a CUDA tensor in a CPU rehearsal) is refused before anything is copied."""
    kind = devices[0].type
    for leaf in leaves:
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
