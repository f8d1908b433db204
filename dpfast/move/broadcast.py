"""Parameters and buffers copied to the replicas: broadcast to other GPUs, connected by autograd, with no copy for
the source (and, for the replicas on the source device, the buffers each replica owns).

``torch.nn.parallel._functions.Broadcast`` returns a copy for every device it is given, the source included, and its
backward sums one gradient per device onto the source. Here the replica on the source device is the module itself,
so the source's copies were dropped and autograd filled their gradients with zeros: a parameter-sized allocation,
fill and addition at every step. :class:`BroadcastToOthers` returns the other devices' copies only and sums only
their gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.cuda import comm


def sum_onto(source: torch.device, rows: Sequence[Sequence[torch.Tensor]], needed: Sequence[bool]) -> list:
    """Per tensor ``k`` with ``needed[k]``, the sum over ``rows`` (one row of tensors per device) on ``source``; None
    for the others. Each row's dense tensors are flattened into one buffer per dtype, moved in one copy and added;
    sparse ones go one by one. Differentiable, so double backward works."""
    out: list = [None] * len(needed)
    groups: dict = {}
    for k, g in enumerate(rows[0]):
        if needed[k]:
            groups.setdefault((g.dtype, g.layout), []).append(k)
    for (_, layout), idx in groups.items():
        if layout != torch.strided:
            for k in idx:
                parts = [row[k].to(source) for row in rows]
                out[k] = sum(parts[1:], parts[0])
            continue
        total = None
        for row in rows:
            flat = _flatten_dense_tensors([row[k] for k in idx]).to(source, non_blocking=True)
            total = flat if total is None else total + flat
        for k, t in zip(idx, _unflatten_dense_tensors(total, [rows[0][k] for k in idx])):
            out[k] = t
    return out


def _distinct(devices: Sequence[torch.device]) -> list[torch.device]:
    return list(dict.fromkeys(devices))


class BroadcastToOthers(torch.autograd.Function):
    """``apply(source, targets, *tensors)`` -> the copies ``[target][tensor]``, flat; ``targets`` exclude ``source``."""

    @staticmethod
    def forward(ctx, source: torch.device, targets: Sequence[torch.device], *tensors: torch.Tensor):
        ctx.source, ctx.targets, ctx.n = source, list(targets), len(tensors)
        rows = comm.broadcast_coalesced(tensors, [source, *targets])[1:]
        needs = ctx.needs_input_grad[2:]
        ctx.mark_non_differentiable(*[row[k] for row in rows for k in range(len(tensors)) if not needs[k]])
        return tuple(t for row in rows for t in row)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        n, targets, source = ctx.n, ctx.targets, ctx.source
        rows = [grads[j * n : (j + 1) * n] for j in range(len(targets))]
        # The engine orders this node against the current stream of its first output's device (targets[0]) only:
        # the other devices whose gradients it reads, and the source it writes to, wait for that stream first, and
        # that stream waits for the source's, where the sums end up, last.
        bridge = source.type == "cuda"  # always, but for the CPU test of this function
        if bridge:
            own = torch.cuda.current_stream(targets[0])
            for d in _distinct([*targets[1:], source]):
                if d != targets[0]:
                    torch.cuda.current_stream(d).wait_stream(own)
        summed = sum_onto(source, rows, ctx.needs_input_grad[2:])
        if bridge:
            own.wait_stream(torch.cuda.current_stream(source))
        return (None, None, *summed)


def broadcast_to_others(
    tensors: Sequence[torch.Tensor], source: torch.device, targets: Sequence[torch.device]
) -> list[list[torch.Tensor]]:
    """``[target][tensor]``: a copy of every tensor (all on ``source``) on each target, connected by autograd."""
    flat = BroadcastToOthers.apply(source, list(targets), *tensors)
    flat = (flat,) if isinstance(flat, torch.Tensor) else flat
    n = len(tensors)
    return [list(flat[j * n : (j + 1) * n]) for j in range(len(targets))]


def broadcast(
    tensors: Sequence[torch.Tensor], source: torch.device, targets: Sequence[torch.device], detach: bool
) -> list[list[torch.Tensor]]:
    """A copy of every tensor per target device, ``[target][tensor]``; autograd-connected unless ``detach``."""
    if not targets:
        return []
    if not tensors:
        return [[] for _ in targets]
    if all(d.type == "cuda" for d in targets) and source.type == "cuda":
        if not detach and source not in targets:  # no copy for the source, so no zero gradient for it either
            return broadcast_to_others(tensors, source, targets)
        from torch.nn.parallel.replicate import _broadcast_coalesced_reshape

        # the source must come first; its own copies are dropped
        return _broadcast_coalesced_reshape(list(tensors), [source] + list(targets), detach=detach)[1:]
    # test switch on the CPU: clones, connected by autograd (a clone's gradient flows back to its input)
    out = []
    for _ in targets:
        if detach:
            out.append([t.detach().clone() for t in tensors])
        else:
            out.append([t.clone() for t in tensors])
    return out


def fresh(t: torch.Tensor, detach: bool) -> torch.Tensor:
    """A replica's own copy of a buffer: autograd-connected when it requires grad, as torch broadcasts it."""
    return t.detach().clone() if detach or not t.requires_grad else t.clone()


def buffer_copies(
    buffers: Sequence[torch.Tensor], source: torch.device, devices: Sequence[torch.device], detach: bool
) -> list[list[torch.Tensor]]:
    """Per device, a copy of every buffer: broadcast with autograd for those that require grad, detached else."""
    rg = [k for k, b in enumerate(buffers) if b.requires_grad and not detach]
    if not rg:
        return broadcast(buffers, source, devices, True)
    nrg = [k for k in range(len(buffers)) if k not in set(rg)]
    c_rg = broadcast([buffers[k] for k in rg], source, devices, False)
    c_nrg = broadcast([buffers[k] for k in nrg], source, devices, True)
    rows = []
    for row_rg, row_nrg in zip(c_rg, c_nrg):
        row: list = [None] * len(buffers)
        for k, t in zip(rg, row_rg):
            row[k] = t
        for k, t in zip(nrg, row_nrg):
            row[k] = t
        rows.append(row)
    return rows
