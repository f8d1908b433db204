"""Gather the replicas' output trees into one, leaf by leaf as ``out_dims`` says, through :mod:`dpfast.ops`.

Concatenations are differentiable (gradients of the gathered outputs flow back to the replicas); ``"sum"`` and
``"mean"`` are plain autograd arithmetic. A concatenation keeps replica 0's memory format (channels_last in,
channels_last out), as torch's gather does.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .. import ops
from ..trees.containers import TreeDef, describe_value, is_namedtuple
from ..trees.flatten import read_along, skeleton_of, unflatten
from ..trees.specs import ITEMS, Leaf, Spec, match_spec
from .nested import gather_jagged
from .scatter import inverse, memory_order, move, move_all


class OutputSkeleton:
    """The structure of the last outputs gathered under one ``out_dims`` (kept by the wrapper's settings, which a
    changed ``out_dims`` or ``dim`` replaces): when every replica returns that very structure again, with a plain
    tensor at every leaf under an int spec, the outputs are read along it and gathered in one call, without
    walking specs or making a record per leaf. Anything else is gathered by the full walk."""

    __slots__ = ("kept", "signature")

    def __init__(self) -> None:
        # (skeleton, per leaf its int spec, per leaf (path, explicit)), replaced whole: calls from other threads
        # read one consistent triple
        self.kept: tuple[Any, list[int], list[tuple[Any, bool]]] | None = None
        self.signature: tuple | None = None

    def remember(self, tdef: TreeDef, leaves: list[Leaf]) -> None:
        """Keep the structure of outputs the full walk just gathered, once the same count of leaves came twice in a
        row (a workload whose outputs change every call never pays for a skeleton)."""
        signature = (tdef.kind, len(leaves))
        if self.signature == signature and all(
            type(leaf.spec) is int and type(leaf.value) is Tensor for leaf in leaves
        ):
            skeleton = skeleton_of(tdef, [leaf.value for leaf in leaves])
            if skeleton is not None:
                specs = [leaf.spec for leaf in leaves]
                self.kept = (skeleton, specs, [(leaf._where, leaf.explicit) for leaf in leaves])
        self.signature = signature

    def gather(self, outputs: Sequence[Any], device: torch.device, sizes: Sequence[int]) -> Any:
        """The outputs read along the skeleton and gathered, or :data:`_AGAIN` when nothing is kept, or they have
        another structure or anything but plain tensors (the full walk then gathers them)."""
        kept = self.kept
        if kept is None:
            return _AGAIN
        skeleton, specs, paths = kept
        columns, tdef = [], None
        for out in outputs:
            flat: list = []
            defs: list = []
            if not read_along((skeleton,), (out,), flat, defs):
                return _AGAIN
            tdef = defs[0] if tdef is None else tdef  # replica 0's structure: the result's
            columns.append(flat)
        done = ops._gather_many(columns, specs, device, list(sizes))
        if done is None:
            return _SAME_STRUCTURE
        outs, follows, all_done = done
        if not all_done:  # a leaf the extension left (0-dim outputs, stacked...), or a warning: leaf by leaf
            weights = _weights(sizes)
            for k, (out, ok, (where, explicit)) in enumerate(zip(outs, follows, paths)):
                if out is None or not ok:
                    leaf = Leaf(where, columns[0][k], specs[k], explicit, -1, k, tuple(c[k] for c in columns[1:]))
                    outs[k] = _leaf_result(leaf, out, ok, device, weights, sizes)
        return unflatten(tdef, outs)


def _leaf_result(
    leaf: Leaf, out: Tensor | None, follows: bool, device: torch.device, weights: list[float], sizes: Sequence[int]
) -> Any:
    """A leaf's result from what the extension made of it: gathered here where it left the leaf (None), or its
    result, warned about where the chunks do not follow the call's sizes."""
    if out is None:
        return _gather_leaf(leaf, [leaf.value, *leaf.others], device, weights, sizes)
    return out if follows else _warned(leaf, out, sizes)


_AGAIN = object()  # OutputSkeleton.gather: the full walk must gather these outputs
_SAME_STRUCTURE = object()  # ... and they have the kept structure, which stays kept (the same one would be made)


def gather_outputs(
    outputs: Sequence[Any],
    out_dims: Spec,
    dim: int,
    device: torch.device,
    sizes: Sequence[int],
    kept: OutputSkeleton | None = None,
) -> Any:
    """Combine the replicas' outputs leaf by leaf as ``out_dims`` says, onto ``device``.

    ``int``: concatenate along that axis (0-dim tensors are stacked into ``(n_replicas,)``; PackedSequences are
    merged by sequence, in the caller's order; jagged nested tensors along their batch axis 0; non-tensor values
    come back once when every replica returned an equal value, else as a list with one value per replica);
    ``"items"``: the replicas' sequences concatenated; ``None``: replica 0's value; ``"sum"``; ``"mean"``:
    weighted by each replica's share of the batch, so a per-sample-mean loss equals the full-batch mean even when
    the split is uneven. ``kept``: the structure of earlier outputs under this very ``out_dims`` and ``dim``, to
    gather outputs of the same structure without walking them (and to keep this call's).
    """
    if kept is not None:
        result = kept.gather(outputs, device, sizes)
        if result is not _AGAIN and result is not _SAME_STRUCTURE:
            return result
        if result is _SAME_STRUCTURE:
            kept = None
    spec = dim if out_dims is None else out_dims
    leaves: list[Leaf] = []
    # one walk over every replica's output: replica 0's leaves, each with the others' values at the same place
    # (a list of ids every replica passed through is one leaf, not one per id)
    tdef = match_spec(
        outputs[0], spec, "output", dim, out_dims is not None, "out_dims", leaves, tuple(outputs[1:]), whole_atoms=True
    )
    weights = _weights(sizes)
    gathered, follows = _gather_plain(leaves, device, sizes)
    result = unflatten(
        tdef, [_leaf_result(leaf, out, ok, device, weights, sizes) for leaf, out, ok in zip(leaves, gathered, follows)]
    )
    if kept is not None:
        kept.remember(tdef, leaves)
    return result


def _weights(sizes: Sequence[int]) -> list[float]:
    """Each replica's share of the batch (``"mean"`` weighs by it)."""
    total = sum(sizes)
    return [s / total for s in sizes] if total > 0 else [1.0 / len(sizes)] * len(sizes)


def _gather_plain(leaves: Sequence[Leaf], device: torch.device, sizes: Sequence[int]) -> tuple[list, list]:
    """Every leaf under an int spec whose replicas returned plain dense tensors, gathered in one call into the
    extension (ops.gather per leaf, without a Python round trip each); None for the others, which
    :func:`_gather_leaf` combines one by one, with its checks and messages."""
    none = [None] * len(leaves)
    picked = [leaf for leaf in leaves if type(leaf.spec) is int]
    if not picked:
        return none, none
    columns = [[leaf.value for leaf in picked]]
    columns += [[leaf.others[r] for leaf in picked] for r in range(len(picked[0].others))]
    done = ops._gather_many(columns, [leaf.spec for leaf in picked], device, list(sizes))
    if done is None:
        return none, none
    if len(picked) == len(leaves):
        return done[0], done[1]
    gathered, follows = list(none), list(none)
    for leaf, out, ok in zip(picked, done[0], done[1]):
        gathered[leaf.index], follows[leaf.index] = out, ok
    return gathered, follows


def _warned(leaf: Leaf, out: Tensor, sizes: Sequence[int]) -> Tensor:
    """A plain leaf gathered whose replicas' sizes along its axis are not the chunk sizes: maybe a warning."""
    _warn_if_batch_elsewhere(leaf, leaf.spec, leaf.spec % out.dim(), [leaf.value, *leaf.others], sizes)
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
        return values[0] if _all_equal(values) else list(values)
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
        _check_concatenable(leaf, spec, values, sizes)
    axis = spec % ref.dim()
    perm = memory_order(ref)
    try:  # ops.gather checks dims, dtypes and shapes before it copies anything
        if perm is None:
            out = ops.gather(values, axis, device)
        else:  # replica 0 returned channels_last: gather the NHWC views (a contiguous NHWC result), view back
            out = ops.gather([v.permute(perm) for v in values], perm.index(axis), device).permute(inverse(perm))
    except (ValueError, IndexError):
        _check_concatenable(leaf, spec, values, sizes)  # the same problem, worded for the output and its replicas
        raise
    _warn_if_batch_elsewhere(leaf, spec, axis, values, sizes)
    return out


def _check_concatenable(leaf: Leaf, spec: int, values: list, sizes: Sequence[int]) -> None:
    ref = values[0]
    if not -ref.dim() <= spec < ref.dim():
        raise ValueError(
            f"output `{leaf.path}` cannot be concatenated along axis {spec}: replica 0 returned shape "
            f"{tuple(ref.shape)}, which has no axis {spec}; give it another out_dims axis, or None/'sum'/'mean'"
        )
    for r, v in enumerate(values):
        if v.dim() != ref.dim() or not -v.dim() <= spec < v.dim():
            raise ValueError(
                f"output `{leaf.path}` cannot be concatenated along axis {spec}: replica {r} returned shape "
                f"{tuple(v.shape)}, replica 0 {tuple(ref.shape)}; give it another out_dims axis, or None/'sum'/'mean'"
            )
    axis = spec % ref.dim()
    follows = [k for k in range(ref.dim()) if len(values) == len(sizes) and [v.shape[k] for v in values] == list(sizes)]
    if axis in follows and len(follows) > 1:
        shapes = ", ".join(str(tuple(v.shape)) for v in values)
        raise ValueError(
            f"output `{leaf.path}` cannot be concatenated along axis {spec}: the replicas returned {shapes}, where "
            f"axes {follows} all follow each replica's chunk ({list(sizes)} samples): a result between the samples of "
            "one chunk (a similarity or contrastive logits matrix) covers only that chunk, not the batch. Compute it "
            "from the gathered outputs after the call, or gather inside forward (dpfast.all_gather)"
        )
    for r, v in enumerate(values):
        if v.dtype != ref.dtype or any(a != b for i, (a, b) in enumerate(zip(v.shape, ref.shape)) if i != axis):
            raise ValueError(
                f"output `{leaf.path}` cannot be concatenated along axis {spec}: replica {r} returned "
                f"{tuple(v.shape)} {v.dtype}, replica 0 {tuple(ref.shape)} {ref.dtype}; all other axes and the "
                "dtype must agree (is the batch on another axis? set out_dims for it)"
            )


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


def _warn_if_batch_elsewhere(leaf: Leaf, spec: int, axis: int, values: list, sizes: Sequence[int]) -> None:
    """An output whose batch lies on another axis concatenates fine when the split is even, into a wrong shape
    (an LSTM state (L, B, H) under the default out_dims 0 comes back (n*L, B/n, H)). Say so when exactly
    another axis carries the chunk sizes and the chosen one does not."""
    if len(values) < 2 or len(values) != len(sizes):
        return
    got = [v.shape[axis] for v in values]
    if got == list(sizes):
        return
    others = [k for k in range(values[0].dim()) if k != axis and [v.shape[k] for v in values] == list(sizes)]
    if others:
        warnings.warn(
            f"output `{leaf.path}` is concatenated along axis {spec}, where the replicas returned sizes {got}, but its "
            f"axis {others[0]} carries the batch chunk sizes {list(sizes)}; if the batch is on that axis, set "
            f"out_dims for `{leaf.path}` to {others[0]} (as given, the result has a different shape than the plain "
            "module's)",
            UserWarning,
            stacklevel=4,
        )


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
