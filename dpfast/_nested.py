"""Nested tensors under an int spec. A jagged nested tensor (``layout=torch.jagged``, ragged on dim 1: ``(B, j, *)``)
is a batch of ``B`` variable-length samples stored as one ``values`` tensor ``(sum j, *)`` and ``offsets``
``(B + 1,)``, so a contiguous run of samples is a contiguous run of ``values`` rows: it is split (and gathered) along
its batch axis 0 by one fused op on ``values``, with the offsets rebased. Any other nested tensor is refused before
anything is copied or run (:func:`nested_problem`, raised by the planning stage)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import ops


def _jagged_dim(nt: Tensor) -> int | None:
    return getattr(nt, "_ragged_idx", None)


def nested_problem(nt: Tensor, path: str, spec: int) -> str | None:
    """Why ``nt`` (a nested tensor under the int spec ``spec``) cannot be split, or None when it can."""
    if nt.layout != torch.jagged:
        return (
            f"`{path}` is a nested tensor with layout {nt.layout}; dpfast splits nested tensors with "
            "layout=torch.jagged (torch.nested.nested_tensor(..., layout=torch.jagged)) along their batch axis 0: "
            "convert it, or give it the spec None to pass it whole to every replica"
        )
    if spec % nt.dim() != 0:
        return (
            f"`{path}` is a jagged nested tensor, which dpfast splits along its batch axis 0 only (its spec is "
            f"{spec}); give it the spec 0, or None to pass it whole to every replica"
        )
    if _jagged_dim(nt) != 1:
        return (
            f"`{path}` is a jagged nested tensor ragged on dim {_jagged_dim(nt)}; dpfast splits those ragged on dim 1 "
            "((B, j, ...)): transpose it, or give it the spec None to pass it whole to every replica"
        )
    if nt.lengths() is not None:
        return f"`{path}` is a non-contiguous jagged nested tensor (it has lengths); pass nt.contiguous() instead"
    return None


def scatter_jagged(nt: Tensor, sizes: Sequence[int], devices: Sequence[torch.device]) -> list[Tensor]:
    """Samples ``[start, start + sizes[j])`` of ``nt`` on ``devices[j]``, jagged, differentiable through values."""
    offsets = nt.offsets()
    bounds = offsets.tolist()
    spans, start = [], 0
    for s in sizes:
        spans.append((start, start + s))
        start += s
    rows = [bounds[b] - bounds[a] for a, b in spans]
    chunks = ops.scatter([nt.values()], 0, rows, devices)[0]
    out = []
    for (a, b), values, device in zip(spans, chunks, devices):
        part = (offsets[a : b + 1] - bounds[a]).to(device)
        out.append(torch.nested.nested_tensor_from_jagged(values, part))
    return out


def gather_jagged(parts: Sequence[Tensor], device: torch.device) -> Tensor:
    """The inverse of :func:`scatter_jagged`: the replicas' jagged outputs concatenated along the batch axis."""
    values = ops.gather([p.values() for p in parts], 0, device)
    offsets, shift = [], 0
    for k, p in enumerate(parts):
        o = p.offsets().to(device)
        offsets.append((o if k == 0 else o[1:]) + shift)
        shift += int(o[-1])
    return torch.nested.nested_tensor_from_jagged(values, torch.cat(offsets))
