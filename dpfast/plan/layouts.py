"""Which tensors under an int spec can be split, and how: dense (strided) tensors along their batch axis by the
fused ops; quantized ones by torch (narrowed and copied: their bytes are integers with scales that torch slices);
jagged nested tensors (``layout=torch.jagged``) ragged on dim 1 along their batch axis 0 (:mod:`dpfast.move.nested`
does it). Everything else (sparse layouts, other nested tensors, mkldnn) is refused here, before anything is copied
or run, with the path and what to do instead."""

from __future__ import annotations

import torch
from torch import Tensor

from ..trees.specs import Leaf

_REPLICATE = "or give it the spec None to pass it whole to every replica"


def split_method(leaf: Leaf) -> tuple[str, str | None]:
    """``(method, problem)``: how the tensor ``leaf.value`` (under an int spec) is split ("tensor", "quantized",
    "jagged"), and why it cannot be (None when it can)."""
    t = leaf.value
    if t.layout == torch.strided and not t.is_nested and not t.is_quantized:  # the common case first
        return "tensor", None
    if t.is_nested:
        return "jagged", nested_problem(t, leaf.path, leaf.spec)
    if t.layout != torch.strided:
        kind = "a sparse tensor" if "sparse" in str(t.layout) else "a tensor"
        path = leaf.path
        return "tensor", (
            f"`{path}` is {kind} with layout {t.layout}; dpfast splits dense (strided) tensors along a batch axis: "
            f"pass it dense (`{path}`.to_dense()), {_REPLICATE} (a sparse matrix whose indices span the whole batch, "
            "such as a graph's adjacency, cannot be split by rows: pass the samples as a list under 'items')"
        )
    return "quantized", None


def nested_problem(nt: Tensor, path: str, spec: int) -> str | None:
    """Why ``nt`` (a nested tensor under the int spec ``spec``) cannot be split, or None when it can."""
    if nt.layout != torch.jagged:
        return (
            f"`{path}` is a nested tensor with layout {nt.layout}; dpfast splits nested tensors with "
            "layout=torch.jagged (torch.nested.nested_tensor(..., layout=torch.jagged)) along their batch axis 0: "
            f"convert it, {_REPLICATE}"
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


def _jagged_dim(nt: Tensor) -> int | None:
    return getattr(nt, "_ragged_idx", None)
