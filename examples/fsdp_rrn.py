"""Seed 000's RRN under FSDP2: ``dpfast.distributed.fully_shard`` with the same specs as ``DataParallel``.

Run::

    torchrun --nproc_per_node=2 examples/fsdp_rrn.py          # CPU (gloo), or one GPU per process (NCCL)

The switch from ``examples/ddp_rrn.py`` is one line::

    dpfast.DistributedDataParallel(model, in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True)
    dpfast.distributed.fully_shard(model, in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True)

The parameters are sharded over the ranks (each holds 1/W of every one); every rank builds the same **global** batch
(same seed) and keeps its rows; with ``gather_outputs=True`` it gets the full-batch ``(out, hidden, h)`` back and
feeds the state into the next reasoning call. After FSDP's gradient reduction the gradients are exactly the
single-process full-batch ones, which the float64 check below verifies on every rank before training.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor

import dpfast.distributed

try:
    from .ddp_rrn import loss_of, setup
    from .rrn import IN_DIMS, OUT_DIMS, Config, build_model, make_batch, reason
except ImportError:  # run as a script: torchrun examples/fsdp_rrn.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ddp_rrn import loss_of, setup  # type: ignore[import-not-found,no-redef]
    from rrn import IN_DIMS, OUT_DIMS, Config, build_model, make_batch, reason  # type: ignore[import-not-found,no-redef]


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """The one line: the RRN under FSDP2 with the specs of DataParallel (the same module comes back)."""
    return dpfast.distributed.fully_shard(model, in_dims=IN_DIMS, out_dims=OUT_DIMS, gather_outputs=True)


def _full(t: Tensor | None) -> Tensor | None:
    full = getattr(t, "full_tensor", None)  # a sharded parameter's gradient is a DTensor
    return full() if full is not None else t


def check(cfg: Config, device: torch.device, batch: int) -> float:
    """Float64, eval mode (dropout off): the gathered outputs and every gradient vs the unsharded model on the whole
    batch, over ``cfg.reasoning_steps`` calls feeding the state back. Returns the worst difference."""
    torch.manual_seed(0)
    plain = build_model(cfg, device).double().eval()
    sharded = shard(copy.deepcopy(plain))
    gen = torch.Generator().manual_seed(1234)
    x, target = make_batch(cfg, gen, device, batch=batch)
    x = x.double()
    h, c = (torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device) for t in plain.reset_g(batch))
    h0 = (h, c)
    want = reason(plain, x, h0, cfg.reasoning_steps)
    loss_of(want, target, cfg.output_dim).backward()
    got = reason(sharded, x, h0, cfg.reasoning_steps)
    loss_of(got, target, cfg.output_dim).backward()
    pairs = [
        (a, b)
        for g, w in zip(got, want)
        for a, b in zip(torch.utils._pytree.tree_leaves(g), torch.utils._pytree.tree_leaves(w))
    ]
    pairs += [(_full(p.grad), q.grad) for p, q in zip(sharded.parameters(), plain.parameters())]
    worst = 0.0
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        worst = max(worst, float((a - b).detach().abs().max()) if a.numel() else 0.0)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=10, help="global batch size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    args = parser.parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = Config(batch=args.batch, train_steps=args.steps)
    say(f"[fsdp_rrn] {world} rank(s), backend {dist.get_backend()}, device {device.type}; global batch {cfg.batch}")

    # 1. exactness: the global batch, and one smaller than the world size (some ranks get no rows: the RRN refuses
    #    an empty batch, so those run a stand-in sample that counts as nothing)
    for b in sorted({cfg.batch, max(1, world - 1)}, reverse=True):
        worst = check(cfg, device, b)
        say(f"  check B={b}: outputs and gradients == single-process full batch (float64), max |diff| {worst:.1e}")

    # 2. training, as the seed does: the state fed back each call
    torch.manual_seed(0)  # FSDP2 broadcasts nothing: every rank builds the same model
    model = build_model(cfg, device)
    shard(model)  # the same module, sharded in place
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, target = make_batch(cfg, torch.Generator().manual_seed(0), device)
    losses = []
    for step in range(cfg.train_steps):
        results = reason(model, x, model.reset_g(x.size(0)), cfg.reasoning_steps)
        loss = loss_of(results, target, cfg.output_dim)  # gathered: the full-batch loss, the same on every rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        say(f"  step {step + 1}: loss {loss.item():.4f}")
    passed = losses[-1] < losses[0]
    say(f"[fsdp_rrn] {'PASS' if passed else 'FAIL'}: exact vs single process, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
