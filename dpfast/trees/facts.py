"""What a leaf is, by value: the facts a call program is keyed on (:func:`leaf_fact`), and a tensor's memory order
(a ``channels_last`` tensor is an NHWC tensor in memory; it moves as that and comes back in its own format).

Two leaves with equal facts are treated alike by every stage: planning, scatter, taking rows, gathering. Sizes are
not facts (a program serves every batch size); what decides how a leaf moves is (its kind, dtype, number of dims,
layout, device type, ``requires_grad``, memory format).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..ext.loader import C

_LAST = {4: (torch.channels_last, (0, 2, 3, 1)), 5: (torch.channels_last_3d, (0, 2, 3, 4, 1))}


def memory_order(t: Tensor) -> tuple[int, ...] | None:
    """The permutation that views a channels_last (3d) tensor as the contiguous tensor it is in memory (NCHW ->
    NHWC), or None for any other tensor (those move as contiguous chunks)."""
    last = _LAST.get(t.dim())
    if last is None or t.is_nested or not t.is_contiguous(memory_format=last[0]):
        return None
    if t.is_contiguous() and not _strides_like_channels_last(t):  # both formats: the strides decide, as for torch
        return None
    return last[1]


def _strides_like_channels_last(t: Tensor) -> bool:
    """torch's own tie-break for a tensor contiguous in both formats (a chunk of one channel, of 1x1 pixels):
    c10's ``is_channels_last_strides_2d/3d``, which ``torch.cat`` and ``empty_like`` follow. Strides must grow
    through C, W, (D,) H, N, and N's may not equal C's (an N111 tensor is NCHW)."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    low = 0
    for d in (1, *range(t.dim() - 1, 1, -1), 0):
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def inverse(perm: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(range(len(perm)), key=lambda i: perm[i]))


def tensor_fact(t: Tensor) -> tuple:
    """A tensor's facts: its dtype, dims, layout, ``requires_grad`` and device type; where it is not a plain tensor
    of its layout also its type, whether it is channels_last, or (nested) where it is ragged and whether it is
    contiguous. Tuples of values only (a plain CPU tensor's is read in a few attribute reads)."""
    nd = t.dim()
    if nd not in (4, 5) and t.is_cpu and type(t) is Tensor and not t.is_nested:  # the common case
        return (t.dtype, nd, t.layout, t.requires_grad)
    if t.is_nested:  # how it splits depends on where it is ragged, and whether it is contiguous
        jagged = t.layout == torch.jagged
        ragged = (getattr(t, "_ragged_idx", None), t.lengths() is None) if jagged else None
        return (type(t), t.dtype, nd, t.layout, t.device.type, t.requires_grad, "nested", ragged)
    last = nd in (4, 5) and memory_order(t) is not None
    return (type(t), t.dtype, nd, t.layout, t.device.type, t.requires_grad, "last" if last else "", None)


def leaf_fact(v: Any) -> Any:
    """A leaf's facts: a tensor's (:func:`tensor_fact`), a PackedSequence's data's, else its type: values passed by
    reference are keyed by their type, never their identity."""
    if type(v) is Tensor or isinstance(v, Tensor):
        return tensor_fact(v)
    if isinstance(v, PackedSequence):
        return (PackedSequence, tensor_fact(v.data))
    return type(v)


def leaf_facts(values: list) -> Any:
    """Every leaf's facts, in order: with a walk's structure, the key of a value. With the compiled extension the
    plain tensors' facts are read in one call (4 bytes each, csrc/python_many.cpp) and the others' here."""
    read = _read_codes(values) if _read_codes is not None else NotImplemented
    if read is NotImplemented:  # (no extension, or a __torch_function__ mode that must see every tensor read)
        return tuple(map(leaf_fact, values))
    codes, others = read
    return codes, tuple([leaf_fact(values[i]) for i in others]) if others else ()


_read_codes = getattr(C, "_leaf_facts", None) if C is not None else None
