"""Gather the replicas' output trees into one, leaf by leaf as ``out_dims`` says, through :mod:`dpfast.ops`.

Concatenations are differentiable (gradients of the gathered outputs flow back to the replicas); ``"sum"`` and
``"mean"`` are plain autograd arithmetic. A concatenation keeps replica 0's memory format (channels_last in,
channels_last out), as torch's gather does.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .. import ops
from ..plan.program import ProgramCache
from ..trees.containers import describe_value, is_namedtuple, node_kind
from ..trees.facts import inverse, memory_order
from ..trees.flatten import unflatten
from ..trees.specs import ITEMS, Leaf, Spec
from ..trees.walk import walk
from .gather_checks import check_concatenable, check_same_structure, warn_ambiguous_axis, warn_if_batch_elsewhere
from .nested import gather_jagged
from .scatter import move, move_all


class GatherProgram:
    """What gathering decides about every leaf of outputs of one key (replica 0's, when every replica's is the
    same): its spec and path; the leaves under an int spec are gathered in one call into the extension, the others
    (and any the extension leaves) one by one, with their checks and messages."""

    __slots__ = ("specs", "places", "plain")

    def __init__(self, leaves: Sequence[Leaf]) -> None:
        self.specs = [leaf.spec for leaf in leaves]
        self.places = [(leaf._where, leaf.explicit) for leaf in leaves]  # for a record, when a leaf needs one
        self.plain = [k for k, s in enumerate(self.specs) if type(s) is int]

    def run(
        self, columns: Sequence[list], device: torch.device, sizes: Sequence[int], off_axis: frozenset = frozenset()
    ) -> list:
        """Every leaf combined from ``columns`` (replica ``r``'s leaf values: ``columns[r]``); ``off_axis``: the
        call's inputs split on another axis than 0 (see :meth:`_warn_if_ambiguous`)."""
        n = len(self.specs)
        outs: list = [None] * n
        follows: list = [None] * n
        plain = self.plain
        if plain:
            picked = [[col[k] for k in plain] for col in columns] if len(plain) < n else columns
            done = ops._gather_many(picked, [self.specs[k] for k in plain], device, list(sizes))
            if off_axis:
                self._warn_if_ambiguous(columns, sizes, off_axis, done[1] if done is not None else None)
            if done is not None and done[2] and len(plain) == n:
                return done[0]  # every leaf gathered, every one following the call's sizes
            if done is not None:
                for k, out, ok in zip(plain, done[0], done[1]):
                    outs[k], follows[k] = out, ok
        weights = _weights(sizes)
        for k in range(n):
            out, ok = outs[k], follows[k]
            if out is not None and ok:
                continue
            where, explicit = self.places[k]
            leaf = Leaf(where, columns[0][k], self.specs[k], explicit, -1, k)
            values = [col[k] for col in columns]
            if out is None:
                outs[k] = _gather_leaf(leaf, values, device, weights, sizes)
            else:
                outs[k] = _warned(leaf, out, values, sizes)
        return outs

    def _warn_if_ambiguous(
        self, columns: Sequence[list], sizes: Sequence[int], off_axis: frozenset, follows: Sequence[bool] | None
    ) -> None:
        """A leaf under the default spec whose concatenation axis carries the chunk sizes, and so does an axis that
        an input of its ndim was split on (a GRU state (layers, B, H) when each chunk is ``layers`` rows): it
        concatenates silently into a wrong shape, so say so, as when only the other axis carries them.
        ``follows``: per plain leaf, whether its concatenation axis carries the chunk sizes, as the extension's
        gather found (None: read here)."""
        for i, k in enumerate(self.plain):
            where, explicit = self.places[k]
            v = columns[0][k]
            if explicit or not isinstance(v, Tensor) or v.dim() < 2 or (follows is not None and not follows[i]):
                continue
            axis = self.specs[k] % v.dim()
            values = [col[k] for col in columns]
            if follows is None and _sizes_along(values, axis) != list(sizes):
                continue  # (not concatenated as the chunks: warn_if_batch_elsewhere's case)
            for ndim, other in off_axis:
                if ndim == v.dim() and other != axis and _sizes_along(values, other) == list(sizes):
                    warn_ambiguous_axis(Leaf(where, v, self.specs[k], explicit, -1, k), axis, other, sizes)
                    break


def _sizes_along(values: list, axis: int) -> list[int] | None:
    if any(not isinstance(v, Tensor) or v.dim() <= axis for v in values):
        return None
    return [v.shape[axis] for v in values]


def gather_outputs(
    outputs: Sequence[Any],
    out_dims: Spec,
    dim: int,
    device: torch.device,
    sizes: Sequence[int],
    programs: ProgramCache | None = None,
    off_axis: frozenset = frozenset(),
) -> Any:
    """Combine the replicas' outputs leaf by leaf as ``out_dims`` says, onto ``device``.

    ``int``: concatenate along that axis (0-dim tensors are stacked into ``(n_replicas,)``; PackedSequences are
    merged by sequence, in the caller's order; jagged nested tensors along their batch axis 0; non-tensor values
    come back once when every replica returned an equal value, else as a list with one value per replica);
    ``"items"``: the replicas' sequences concatenated; ``None``: replica 0's value; ``"sum"``; ``"mean"``:
    weighted by each replica's share of the batch, so a per-sample-mean loss equals the full-batch mean even when
    the split is uneven. ``programs``: the gather programs of earlier outputs under this very ``out_dims`` and
    ``dim``, by key (outputs of a key seen before are gathered by its program, and a new key's is kept).
    ``off_axis``: ``(ndim, axis)`` of the call's inputs split on an axis other than 0, where an output of that
    ndim may hold its batch (a warning says so when its concatenation axis is then ambiguous).
    """
    spec, explicit = (dim if out_dims is None else out_dims), out_dims is not None
    # (a gather program depends on the outputs' structure only: the tensors' facts are checked as they are gathered)
    walks = [walk(out, spec, "output", dim, explicit, "out_dims", None) for out in outputs]
    key = walks[0][2]
    same = key is not None and all(w[2] == key for w in walks[1:])
    if not same:
        check_same_structure(walks, outputs)
    program = programs.get(key) if same and programs is not None else None
    if program is None:
        records: list[Leaf] = []
        walk(outputs[0], spec, "output", dim, explicit, "out_dims", records)
        program = GatherProgram(records)
        if same and programs is not None:
            programs.put(key, program)
    return unflatten(walks[0][0], program.run([w[1] for w in walks], device, sizes, off_axis))


def _weights(sizes: Sequence[int]) -> list[float]:
    """Each replica's share of the batch (``"mean"`` weighs by it)."""
    total = sum(sizes)
    return [s / total for s in sizes] if total > 0 else [1.0 / len(sizes)] * len(sizes)


def _warned(leaf: Leaf, out: Tensor, values: list, sizes: Sequence[int]) -> Tensor:
    """A plain leaf gathered whose replicas' sizes along its axis are not the chunk sizes: maybe a warning."""
    warn_if_batch_elsewhere(leaf, leaf.spec, leaf.spec % out.dim(), values, sizes)
    return out


def _gather_leaf(leaf: Leaf, values: list, device: torch.device, weights: list[float], sizes: Sequence[int]) -> Any:
    """One output leaf from every replica's ``values``, combined as its spec says."""
    spec = leaf.spec  # its path is put into words only for an error
    if all(v is None for v in values):
        return None
    if spec is None:
        return move(values[0], device)
    if spec == ITEMS:
        return _concat_items(leaf, values, device)
    if isinstance(spec, str):
        return _reduce(leaf, spec, values, device, weights)
    if all(isinstance(v, PackedSequence) for v in values):
        return gather_packed(values, device)
    if not any(isinstance(v, (Tensor, PackedSequence)) for v in values):
        # non-tensor outputs (a tag, a count): once when every replica agrees, else one value per replica
        return _non_tensors(leaf, values)
    if not all(isinstance(v, Tensor) for v in values):
        kinds = sorted({type(v).__name__ for v in values})
        raise TypeError(
            f"output `{leaf.path}` is {'/'.join(kinds)}, which cannot be concatenated along axis {spec}; give it "
            "out_dims None (replica 0's value), 'sum' or 'mean'"
        )
    return _concatenate(leaf, spec, values, device, sizes)


def _concatenate(leaf: Leaf, spec: int, values: list[Tensor], device: torch.device, sizes: Sequence[int]) -> Tensor:
    """The replicas' tensors concatenated along ``spec`` (0-dim ones stacked), in replica 0's memory format."""
    if any(v.is_nested for v in values):
        if spec % values[0].dim() != 0 or not all(v.is_nested and v.layout == torch.jagged for v in values):
            raise ValueError(
                f"output `{leaf.path}` is a nested tensor, which dpfast concatenates along its batch axis 0 only when "
                f"every replica returned a jagged one (out_dims {spec}); give it out_dims 0, or None (replica 0's "
                "value)"
            )
        return gather_jagged(values, device)
    if any(v.layout != torch.strided for v in values):
        raise TypeError(
            f"output `{leaf.path}` is a tensor with layout "
            f"{next(v.layout for v in values if v.layout != torch.strided)}, which dpfast does not concatenate; give "
            "it out_dims None (replica 0's value), or return it dense"
        )
    if any(v.is_quantized for v in values):
        return gather_quantized(leaf, spec, values, device)
    if all(v.dim() == 0 for v in values):
        return ops.gather([v.reshape(1) for v in values], 0, device)
    ref = values[0]
    if ref.dim() == 0 or not -ref.dim() <= spec < ref.dim():
        check_concatenable(leaf, spec, values, sizes)
    axis = spec % ref.dim()
    perm = memory_order(ref)
    try:  # ops.gather checks dims, dtypes and shapes before it copies anything
        if perm is None:
            out = ops.gather(values, axis, device)
        else:  # replica 0 returned channels_last: gather the NHWC views (a contiguous NHWC result), view back
            out = ops.gather([v.permute(perm) for v in values], perm.index(axis), device).permute(inverse(perm))
    except (ValueError, IndexError):
        check_concatenable(leaf, spec, values, sizes)  # the same problem, worded for the output and its replicas
        raise
    warn_if_batch_elsewhere(leaf, spec, axis, values, sizes)
    return out


def _concat_items(leaf: Leaf, values: list, device: torch.device) -> Any:
    """The replicas' sequences of per-sample items, concatenated in replica order, with every tensor on ``device``."""
    for r, v in enumerate(values):
        if not isinstance(v, (list, tuple)) or is_namedtuple(v):
            raise TypeError(
                f"out_dims for `{leaf.path}` is 'items', but replica {r} returned {describe_value(v)}; 'items' is for "
                "a list or tuple of per-sample items: give it an int, None, 'sum' or 'mean'"
            )
    items = [move_all(item, device) for v in values for item in v]
    try:
        return type(values[0])(items)
    except Exception:  # a sequence type with its own constructor: a plain list
        return items


def _non_tensors(leaf: Leaf, values: list) -> Any:
    """Non-tensor outputs under an int spec: once when every replica returned an equal value, else one value per
    replica. A container of numbers and strings (one leaf) goes by element, as its elements would: each once where
    the replicas agree on it."""
    ref = values[0]
    if all(v is ref for v in values) or _all_equal(values):
        return ref
    kind = node_kind(ref)
    if kind is None or any(type(v) is not type(ref) for v in values):
        return list(values)
    keys = list(ref) if kind == "dict" else None
    for r, v in enumerate(values):
        if (list(v) != keys) if kind == "dict" else len(v) != len(ref):
            raise ValueError(
                f"replicas returned different output structures: replica 0 returned {describe_value(ref)}, replica "
                f"{r} returned {describe_value(v)} at `{leaf.path}`; every replica must return the same structure"
            )
    if kind == "dict":
        return type(ref)({k: _non_tensors(leaf, [v[k] for v in values]) for k in keys})
    items = [_non_tensors(leaf, [v[i] for v in values]) for i in range(len(ref))]
    return items if type(ref) is list else type(ref)(items)


def _all_equal(values: list) -> bool:
    """Whether every value is replica 0's (identical, or ``==`` answering a plain ``True``)."""
    ref = values[0]
    for v in values[1:]:
        if v is ref:
            continue
        if type(v) is not type(ref):
            return False
        try:
            same = v == ref
        except Exception:
            return False
        if not (isinstance(same, bool) and same):
            return False
    return True


def _reduce(leaf: Leaf, how: str, values: list, device: torch.device, weights: list[float]) -> Any:
    if all(isinstance(v, Tensor) for v in values):
        ref = values[0]
        for r, v in enumerate(values):
            if v.shape != ref.shape:
                raise ValueError(
                    f"output `{leaf.path}` cannot be {'summed' if how == 'sum' else 'averaged'} across replicas: "
                    f"replica {r} returned shape {tuple(v.shape)}, replica 0 {tuple(ref.shape)}; shapes must agree"
                )
        moved = [move(v, device) for v in values]
    elif all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in values):
        moved = list(values)
    else:
        kinds = sorted({type(v).__name__ for v in values})
        raise TypeError(
            f"output `{leaf.path}` is {'/'.join(kinds)}; out_dims {how!r} needs tensors or numbers from every replica"
        )
    if how == "sum":
        out = moved[0]
        for v in moved[1:]:
            out = out + v
        return out
    out = moved[0] * weights[0]
    for v, w in zip(moved[1:], weights[1:]):
        out = out + v * w
    return out


def gather_packed(values: Sequence[PackedSequence], device: torch.device) -> PackedSequence:
    """The inverse of :func:`scatter_packed`: unpack each replica's chunk, concatenate by sequence, re-pack."""
    unpacked = [pad_packed_sequence(v) for v in values]
    t_max = max(p.shape[0] for p, _ in unpacked)
    padded = []
    for p, _ in unpacked:
        if p.shape[0] < t_max:
            p = torch.cat([p, p.new_zeros((t_max - p.shape[0],) + tuple(p.shape[1:]))], 0)
        padded.append(p)
    data = ops.gather(padded, 1, device)
    lengths = torch.cat([lens for _, lens in unpacked])
    return pack_padded_sequence(data, lengths, enforce_sorted=False)


def gather_quantized(leaf: Leaf, spec: int, values: list[Tensor], device: torch.device) -> Tensor:
    """Quantized chunks concatenated by torch, when that is exact: per-tensor quantized, the same dtype, scale and
    zero point on every replica (torch requantizes anything else to the first chunk's scale)."""
    ref = values[0]
    per_tensor = (torch.per_tensor_affine, torch.per_tensor_symmetric)
    same = all(
        v.is_quantized
        and v.qscheme() in per_tensor
        and v.dtype == ref.dtype
        and v.q_scale() == ref.q_scale()
        and v.q_zero_point() == ref.q_zero_point()
        and v.dim() == ref.dim()
        for v in values
    )
    if not same or not -ref.dim() <= spec < ref.dim():
        raise ValueError(
            f"output `{leaf.path}` is a quantized tensor that dpfast cannot concatenate exactly along axis {spec}: it "
            "concatenates per-tensor quantized outputs with the same dtype, scale and zero point on every replica "
            "(here they differ, are per channel, or lack the axis). Dequantize it in forward, or give it out_dims "
            "None (replica 0's value)"
        )
    return torch.cat([v.to(device) for v in values], spec % ref.dim())
