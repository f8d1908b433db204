"""``gather_outputs=True``: combine every rank's outputs so each rank holds the full-batch result.

Int specs are concatenated in rank order (any row count per rank), ``"sum"``/``"mean"`` reduced across ranks
(``"mean"`` weighted by share), ``None`` keeps this rank's value. An output one rank cannot gather (its structure,
type or axis) is reported through the first exchange, so every rank raises instead of the others waiting.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..trees.containers import TreeDef
from ..trees.flatten import unflatten
from ..trees.specs import Leaf, Spec, match_spec
from .exchanges import Exchange, OutputExchange, RankGroup, fingerprint
from .sharding import Share


@dataclasses.dataclass
class _Leaves:
    """The output's leaves sorted for one exchange: numbers under "sum"/"mean" travel as 0-dim tensors."""

    tdef: TreeDef | None = None
    leaves: list[Leaf] = dataclasses.field(default_factory=list)
    slots: list[tuple] = dataclasses.field(default_factory=list)  # per leaf: ("keep",) | ("t", index, number type)
    tensors: list[Tensor] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)  # per tensor: "cat" | "red"
    axes: list[int] = dataclasses.field(default_factory=list)
    weights: list[float] = dataclasses.field(default_factory=list)  # per tensor: this rank's factor
    desc: list[Any] = dataclasses.field(default_factory=list)  # what every rank must agree on


def _rank_weights(share: Share, world: int) -> tuple[list[bool], list[float]]:
    """Which ranks' outputs count, and each rank's weight in a "mean"."""
    if share.sizes:
        return [s > 0 for s in share.sizes], [s / share.batch_size for s in share.sizes]
    return [i == 0 for i in range(world)], [1.0 if i == 0 else 0.0 for i in range(world)]


def _sort_leaves(out: Any, spec: Spec, dim: int, explicit: bool, active: bool, mean_weight: float) -> _Leaves:
    got = _Leaves()
    got.tdef = match_spec(out, spec, "output", dim, explicit, "out_dims", got.leaves)
    for leaf in got.leaves:
        v, s = leaf.value, leaf.spec
        if v is None or s is None:
            got.desc.append((leaf.path, "keep", repr(s), v is None))
            got.slots.append(("keep",))
            continue
        if s == "items":
            raise TypeError(
                f"output `{leaf.path}` has out_dims 'items', which gather_outputs cannot all-gather yet; give it "
                "out_dims None to keep this rank's own items"
            )
        if isinstance(s, str):
            if isinstance(v, Tensor):
                t, num = v, None
            elif isinstance(v, numbers.Number) and not isinstance(v, bool):
                num = type(v) if s == "sum" and isinstance(v, int) else float
                t = torch.tensor(v, dtype=torch.int64 if num is int else torch.float64)
            else:
                raise TypeError(
                    f"output `{leaf.path}` is a {type(v).__name__}; out_dims {s!r} needs tensors or numbers from "
                    "every rank"
                )
            got.desc.append((leaf.path, s, tuple(t.shape), str(t.dtype)))
            got.slots.append(("t", len(got.tensors), num))
            got.tensors.append(t)
            got.kinds.append("red")
            got.axes.append(0)
            got.weights.append(mean_weight if s == "mean" else (1.0 if active else 0.0))
            continue
        if isinstance(v, PackedSequence):
            raise TypeError(
                f"output `{leaf.path}` is a PackedSequence, which gather_outputs cannot all-gather yet; return it "
                "padded (torch.nn.utils.rnn.pad_packed_sequence), or give it out_dims None to keep this rank's own "
                "value"
            )
        if not isinstance(v, Tensor):
            raise TypeError(
                f"output `{leaf.path}` is a {type(v).__name__}, which cannot be concatenated along axis {s}; give it "
                "out_dims None (this rank's value), 'sum' or 'mean'"
            )
        if v.dim() and not -v.dim() <= s < v.dim():
            raise ValueError(
                f"output `{leaf.path}` has shape {tuple(v.shape)}: axis {s} is out of range; give it another "
                "out_dims axis, or None/'sum'/'mean'"
            )
        axis = s % v.dim() if v.dim() else 0
        other = tuple(n for i, n in enumerate(v.shape) if i != axis)
        got.desc.append((leaf.path, "cat", axis, v.dim(), str(v.dtype), other))
        got.slots.append(("t", len(got.tensors), None))
        got.tensors.append(v)
        got.kinds.append("cat")
        got.axes.append(axis)
        got.weights.append(1.0)
    return got


def _exchange_rows(group: RankGroup, got: _Leaves, error: BaseException | None, active: bool) -> list:
    """Per tensor, the rows every rank contributes ("cat"; None for "red"); raises on every rank when the ranks'
    outputs disagree or one could not sort its own."""
    # one small all-gather: structure fingerprint and error status, then (when any) the rows of each "cat" tensor
    n_cat = got.kinds.count("cat")
    head = torch.tensor(
        [fingerprint(got.desc), n_cat, 0 if error is None else 1], dtype=torch.int64, device=group.comm_device
    )
    heads = [torch.empty_like(head) for _ in range(group.world)]
    dist.all_gather(heads, head, group=group.process_group)
    if any(not torch.equal(h, heads[0]) or int(h[2]) for h in heads):
        _raise_disagreement(group, got, error, [i for i, h in enumerate(heads) if int(h[2])])
    rows_per_cat: list[list[int]] = []
    if n_cat:  # n_cat is part of the fingerprint: equal fingerprints mean equal lengths here
        mine = [
            (1 if t.dim() == 0 else t.shape[a]) if active else 0
            for t, k, a in zip(got.tensors, got.kinds, got.axes)
            if k == "cat"
        ]
        body = torch.tensor(mine, dtype=torch.int64, device=group.comm_device)
        bodies = [torch.empty_like(body) for _ in range(group.world)]
        dist.all_gather(bodies, body, group=group.process_group)
        table = [b.tolist() for b in bodies]
        rows_per_cat = [[table[q][j] for q in range(group.world)] for j in range(n_cat)]
    it = iter(rows_per_cat)
    return [next(it) if k == "cat" else None for k in got.kinds]


def _raise_disagreement(group: RankGroup, got: _Leaves, error: BaseException | None, failed: list[int]) -> None:
    summaries: list[Any] = [None] * group.world
    dist.all_gather_object(summaries, list(got.desc), group=group.process_group)
    name = "dpfast.DistributedDataParallel(gather_outputs=True)"
    if failed:
        many = len(failed) > 1
        lines = [
            f"{name}: rank{'s' if many else ''} {', '.join(map(str, failed))} could not gather "
            f"{'their' if many else 'its'} outputs, so no rank gathers them"
        ]
    else:
        lines = [
            f"{name}: the ranks returned different output structures (paths, specs, dtypes or non-batch shapes "
            "differ); every rank must return the same structure to be gathered"
        ]
    for i, s in enumerate(summaries):
        lines.append(f"  rank {i}{' (this rank)' if i == group.rank else ''}: {s}")
    if error is not None:
        raise type(error)("\n".join(lines) + "\n" + str(error)) from error
    raise ValueError("\n".join(lines))


def gather_across_ranks(group: RankGroup, out: Any, out_dims: Spec, dim: int, share: Share) -> Any:
    """Every rank's ``out`` combined leaf by leaf as ``out_dims`` says (a collective: every rank must call it)."""
    active, mean_w = _rank_weights(share, group.world)
    spec = dim if out_dims is None else out_dims
    error: BaseException | None = None
    try:
        got = _sort_leaves(out, spec, dim, out_dims is not None, active[group.rank], mean_w[group.rank])
    except (TypeError, ValueError) as exc:
        error = exc
        got = _Leaves(desc=[("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")])
    rows = _exchange_rows(group, got, error, active[group.rank])
    if not got.tensors:
        return out
    exchange = OutputExchange(
        group.process_group,
        group.comm_device,
        group.rank,
        group.world,
        got.kinds,
        got.axes,
        rows,
        got.weights,
        [tuple(t.shape) for t in got.tensors],
        [t.dtype for t in got.tensors],
        [t.device for t in got.tensors],
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in got.tensors):
        results = Exchange.apply(exchange, *got.tensors)
    else:
        results = exchange.forward(got.tensors)
    values = []
    for leaf, slot in zip(got.leaves, got.slots):
        if slot[0] == "keep":
            values.append(leaf.value)
            continue
        res = results[slot[1]]
        values.append(res.item() if slot[2] is int else (float(res.item()) if slot[2] is float else res))
    return unflatten(got.tdef, values)
