"""Which nested tensors under an int spec can be split: jagged ones (``layout=torch.jagged``) ragged on dim 1, split
along their batch axis 0 (:mod:`dpfast.move.nested` does it); every other nested tensor is refused here, before
anything is copied or run."""

from __future__ import annotations

import torch
from torch import Tensor


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
