"""The checks gathering makes of the replicas' outputs, and the warnings it gives: that they have one structure
(:func:`check_same_structure`), that tensors concatenate along their axis, and why not when they do not
(:func:`check_concatenable`), and that the axis is the batch's (:func:`warn_if_batch_elsewhere`). Messages
only: :mod:`dpfast.move.gather` decides and combines."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from ..trees.containers import LEAF, TreeDef, describe_value
from ..trees.specs import Leaf, path_text


def check_same_structure(walks: Sequence[tuple], outputs: Sequence[Any]) -> None:
    """Raise, naming the first place where a replica's outputs have another structure than replica 0's."""
    for r, (tdef, values, _) in enumerate(walks[1:], start=1):
        where = _first_difference(walks[0][0], walks[0][1], tdef, values)
        if where is not None:
            path, mine, theirs = where
            raise ValueError(
                f"replicas returned different output structures: replica 0 returned {describe_value(mine)}, "
                f"replica {r} returned {describe_value(theirs)} at `{path}`; every replica must return the same "
                "structure"
            )


def _first_difference(a: TreeDef, a_leaves: list, b: TreeDef, b_leaves: list) -> tuple[str, Any, Any] | None:
    """``(path, a's value, b's value)`` where two walked values first differ in structure, or None."""
    stack: list[tuple[TreeDef, TreeDef, Any]] = [(a, b, "output")]
    ia = ib = 0
    while stack:
        x, y, where = stack.pop()
        if x is LEAF or y is LEAF:
            if x is not y:
                mine = a_leaves[ia] if x is LEAF else x.orig
                theirs = b_leaves[ib] if y is LEAF else y.orig
                return path_text(where), mine, theirs
            ia, ib = ia + 1, ib + 1
            continue
        if x.kind != y.kind or not _alike(type(x.orig), type(y.orig)) or list(x.keys) != list(y.keys):
            return path_text(where), x.orig, y.orig
        stack.extend(reversed([(cx, cy, (where, x.kind, k)) for k, cx, cy in zip(x.keys, x.children, y.children)]))
    return None


def _alike(a: type, b: type) -> bool:
    """One class, or two of the same name from the same module: a model that builds its output class per instance
    (pytorch-forecasting's) gives each replica, a copy, its own. With the same fields (compared beside this) they
    are one structure, rebuilt with replica 0's class."""
    return a is b or (a.__qualname__ == b.__qualname__ and a.__module__ == b.__module__)


def check_concatenable(leaf: Leaf, spec: int, values: list, sizes: Sequence[int]) -> None:
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
                f"dtype must agree ({_why_apart(values, axis, sizes)})"
            )


def _why_apart(values: list, axis: int, sizes: Sequence[int]) -> str:
    """What most likely keeps the replicas' tensors from concatenating, and its fixes."""
    differ = [k for k in range(values[0].dim()) if k != axis and len({v.shape[k] for v in values}) > 1]
    if differ and axis in _following(values, sizes):  # the batch is where it should be: another axis is padded
        k = differ[0]
        return (
            f"axis {axis} carries the batch chunks, but axis {k} differs across replicas "
            f"({[v.shape[k] for v in values]}): padded to each chunk's longest sequence? Pad to a fixed length in "
            "forward, return the samples as a list under out_dims 'items', or give it None for replica 0's"
        )
    return "is the batch on another axis? set out_dims for it"


def _following(values: list, sizes: Sequence[int]) -> list[int]:
    """The axes along which the replicas' sizes are the batch chunk sizes."""
    if len(values) != len(sizes) or any(v.dim() != values[0].dim() for v in values):
        return []
    return [k for k in range(values[0].dim()) if [v.shape[k] for v in values] == list(sizes)]


def warn_if_batch_elsewhere(leaf: Leaf, spec: int, axis: int, values: list, sizes: Sequence[int]) -> None:
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


def warn_ambiguous_axis(leaf: Leaf, axis: int, other: int, sizes: Sequence[int]) -> None:
    """Both ``axis`` (the concatenation axis) and ``other`` (one the call's inputs were split on) carry the chunk
    sizes: the concatenation runs, and may not be what the plain module returns."""
    warnings.warn(
        f"output `{leaf.path}` is concatenated along axis {axis}, whose sizes across the replicas equal the batch "
        f"chunk sizes {list(sizes)}, but its axis {other} also carries the batch chunk sizes, and an input was split "
        f"on axis {other}; if the batch of `{leaf.path}` is on axis {other} (an RNN state (layers, B, H) whose "
        f"layer count equals the chunk size), set out_dims for `{leaf.path}` to {other} (as given, the result has a "
        "different shape than the plain module's); if it is on axis 0, set out_dims to 0 to say so",
        UserWarning,
        stacklevel=5,
    )
