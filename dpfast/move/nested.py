"""Jagged nested tensors split and gathered along their batch axis. A jagged nested tensor (``layout=torch.jagged``,
ragged on dim 1: ``(B, j, *)``) is a batch of ``B`` variable-length samples stored as one ``values`` tensor
``(sum j, *)`` and ``offsets`` ``(B + 1,)``, so a contiguous run of samples is a contiguous run of ``values`` rows: it
is split (and gathered) along its batch axis 0 by one fused op on ``values``, with the offsets rebased. The planning
stage has refused every other nested tensor before anything gets here (:mod:`dpfast.plan.layouts`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import ops


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
