"""Before each forward, every rank checks that all ranks were given the same global batch.

One small all-gather of ``(status, B, fingerprint, split)``: the fingerprint hashes the argument structure and the
shape/dtype of every tensor to split (with ``check_batch="values"`` also their bytes), ``split`` the per-rank sizes
(with ``cost`` they depend on the cost values, which shapes alone do not pin down). A disagreement, or a rank
that could not plan its call, raises :class:`DistributedBatchError` on **every** rank, with a line per rank,
instead of leaving the others waiting in a later collective.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..plan.call_plan import CallPlan
from ..plan.errors import ScatterError
from ..plan.render import shape_text
from .exchanges import RankGroup, fingerprint


class DistributedBatchError(ScatterError):
    """The ranks were not given the same global batch (or one rank's inputs are bad); raised on every rank."""


def _local_summary(plan: CallPlan | None, error: BaseException | None) -> str:
    if error is not None or plan is None:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return f"{type(error).__name__}: {first}"
    parts = [f"B = {plan.batch_size if plan.batch_size is not None else '-'}"]
    if plan.balance is not None:
        parts.append(f"split {plan.sizes} by cost")
    parts += [f"{m.path} {shape_text(m.value)}" for m in plan.mapped]
    return ", ".join(parts)


def _fingerprint_items(plan: CallPlan | None, signature_text: str, hash_values: bool) -> list[Any]:
    items: list[Any] = [signature_text]
    if plan is None:
        return items
    tree = plan.tree
    items += [tree.n_args, tree.kw_keys]
    for leaf in tree.leaves:
        v = leaf.value
        m = leaf if leaf.split is not None else None
        if m is None:
            kind = f"tensor(requires_grad={v.requires_grad})" if isinstance(v, Tensor) else type(v).__name__
            items.append((leaf.path, repr(leaf.spec), kind))
            continue
        if m.is_packed:
            items.append((leaf.path, "packed", m.size, str(v.data.dtype), tuple(v.data.shape[1:])))
        else:
            items.append((leaf.path, repr(leaf.spec), tuple(v.shape), str(v.dtype), v.requires_grad))
        if hash_values:
            t = (v.data if m.is_packed else v).detach().contiguous().cpu()
            items.append(hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest())
    return items


def agree_on_batch(
    group: RankGroup, plan: CallPlan | None, error: BaseException | None, signature_text: str, hash_values: bool
) -> None:
    """Return when every rank planned the same batch; raise :class:`DistributedBatchError` on every rank if not.

    ``plan`` is this rank's plan of the call, or ``None`` with the ``error`` that planning raised.
    """
    status = 1 if error is not None else 0
    batch = plan.batch_size if plan is not None else None
    items = _fingerprint_items(plan, signature_text, hash_values)
    split = fingerprint(plan.sizes) if plan is not None else 0
    mine = torch.tensor(
        [status, -1 if batch is None else batch, fingerprint(items), split], dtype=torch.int64, device=group.comm_device
    )
    allv = [torch.empty_like(mine) for _ in range(group.world)]
    dist.all_gather(allv, mine, group=group.process_group)
    rows = [tuple(int(x) for x in t.tolist()) for t in allv]
    if all(row == rows[0] for row in rows) and status == 0:
        return
    # Everyone saw the same rows, so everyone is here: one more collective for a readable message.
    summaries: list[Any] = [None] * group.world
    dist.all_gather_object(summaries, _local_summary(plan, error), group=group.process_group)
    lines = [f"dpfast.DistributedDataParallel: {_headline(rows, hash_values)}"]
    for r, s in enumerate(summaries):
        lines.append(f"  rank {r}{' (this rank)' if r == group.rank else ''}: {s}")
    msg = "\n".join(lines)
    if error is not None:
        raise DistributedBatchError(msg + "\n" + str(error)) from error
    raise DistributedBatchError(msg)


def _headline(rows: list[tuple[int, ...]], hash_values: bool) -> str:
    bad_local = [r for r, row in enumerate(rows) if row[0]]
    if bad_local:
        return (
            f"rank{'s' if len(bad_local) > 1 else ''} {', '.join(map(str, bad_local))} could not split "
            "its inputs, so no rank runs this step"
        )
    bs = sorted({row[1] for row in rows})
    if len(bs) > 1:
        return (
            "the ranks were given different global batches: B differs across ranks "
            f"({', '.join('-' if b < 0 else str(b) for b in bs)}); every rank must get the same "
            "global batch (or load per-rank data and use dpfast.distributed.shard_batch / "
            "shard_dataset with torch's DistributedDataParallel)"
        )
    if len({row[2] for row in rows}) == 1:
        return (
            f"the ranks planned different splits of the same B = {bs[0]}: their cost values or chunk_sizes differ; "
            "every rank must get the same global batch, costs and chunk_sizes"
        )
    what = "shapes, dtypes, structure or values" if hash_values else "shapes, dtypes or structure"
    return (
        f"the ranks were given different global batches: same B = {bs[0]} but different {what} "
        "of the arguments; every rank must get the same global batch"
    )
