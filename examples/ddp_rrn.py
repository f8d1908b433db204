"""Seed 000's RRN on torch.distributed: ``dpfast.DistributedDataParallel`` with the same specs as ``DataParallel``.

Run::

    torchrun --nproc_per_node=2 examples/ddp_rrn.py          # CPU (gloo), or one GPU per process (NCCL)

The switch from ``examples/rrn.py`` is one line::

    dpfast.DataParallel(model, in_dims={"h": 1}, out_dims=(0, 0, 1))
    dpfast.DistributedDataParallel(model, in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True)

Every rank builds the same **global** batch (same seed); each keeps its rows by the plan DataParallel would make over
``world_size`` devices (10 rows on 2 ranks: 5/5; on 3 ranks: 4/3/3). With ``gather_outputs=True`` every rank gets the
full-batch ``(out, hidden, h)`` back, feeds the state into the next reasoning call, and computes the full-batch loss;
DDP's averaged gradients are then exactly the single-process full-batch gradients, which the float64 check below
verifies on every rank before training.

``--per-rank`` instead loads per rank, as DDP users do: every rank passes only its own rows
(``inputs="per_rank"``; here cut with ``dpfast.distributed.shard_batch``, in a real job a per-rank loader such as
``BalancedBatchSampler``), keeps its own state between reasoning calls (no gather), and scales its local mean loss
by ``loss_scale``: the gradients are again exactly the full-batch ones, which the check verifies too.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import dpfast
from dpfast.distributed import shard_batch

try:
    from ._common import sgd_step
    from .rrn import IN_DIMS, OUT_DIMS, Call, Config, build_model, make_batch, reason
except ImportError:  # run as a script: torchrun examples/ddp_rrn.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import sgd_step  # type: ignore[import-not-found,no-redef]
    from rrn import IN_DIMS, OUT_DIMS, Call, Config, build_model, make_batch, reason  # type: ignore[import-not-found,no-redef]


def setup() -> torch.device:
    if "RANK" not in os.environ:  # plain `python examples/ddp_rrn.py`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=60))
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


def loss_of(results: list[Call], target: Tensor, output_dim: int) -> Tensor:
    return torch.stack([F.cross_entropy(o.reshape(-1, output_dim), target.reshape(-1)) for o, _, _ in results]).sum()


def wrap(model: torch.nn.Module, device: torch.device, per_rank: bool) -> dpfast.DistributedDataParallel:
    """The one line: the RRN under dpfast.DistributedDataParallel with the specs of DataParallel."""
    return dpfast.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        inputs="per_rank" if per_rank else "global",
        in_dims=IN_DIMS,
        out_dims=OUT_DIMS,
        gather_outputs=not per_rank,
    )


def check(cfg: Config, device: torch.device, batch: int, per_rank: bool = False) -> float:
    """Float64, eval mode (dropout off): outputs and every gradient vs the unwrapped model on the whole batch, over
    ``cfg.reasoning_steps`` calls feeding the state back (gathered; with ``per_rank`` this rank's own). Returns the
    worst difference."""
    torch.manual_seed(0)
    plain = build_model(cfg, device).double().eval()
    ddp = wrap(copy.deepcopy(plain), device, per_rank)
    gen = torch.Generator().manual_seed(1234)
    x, target = make_batch(cfg, gen, device, batch=batch)
    x = x.double()
    h, c = (torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device) for t in plain.reset_g(batch))
    h0 = (h, c)
    want = reason(plain, x, h0, cfg.reasoning_steps)
    loss_of(want, target, cfg.output_dim).backward()
    if per_rank:  # this rank's rows of everything, as a per-rank loader would give them
        x, h0, target = shard_batch((x, h0, target), in_dims=(0, 1, 0))
        want = [shard_batch(w, in_dims=OUT_DIMS) for w in want]
    got = reason(ddp, x, h0, cfg.reasoning_steps)
    (loss_of(got, target, cfg.output_dim) * (ddp.loss_scale if per_rank else 1.0)).backward()
    pairs = [
        (a, b)
        for g, w in zip(got, want)
        for a, b in zip(torch.utils._pytree.tree_leaves(g), torch.utils._pytree.tree_leaves(w))
    ]
    pairs += [(p.grad, q.grad) for p, q in zip(ddp.module.parameters(), plain.parameters())]
    worst = 0.0
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        worst = max(worst, float((a - b).detach().abs().max()) if a.numel() else 0.0)
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=10, help="global batch size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    parser.add_argument("--per-rank", action="store_true", help="every rank loads only its own rows")
    args = parser.parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = Config(batch=args.batch, train_steps=args.steps)
    mode = "per-rank rows" if args.per_rank else "the global batch on every rank"
    say(f"[ddp_rrn] {world} rank(s), backend {dist.get_backend()}, device {device.type}; global batch {cfg.batch}")
    say(f"  feeding {mode}")

    # 1. exactness: the global batch as given, and (global batch only) one smaller than the world size, so that
    #    some ranks get no rows (the RRN refuses an empty batch: those run a stand-in sample that counts as nothing)
    sizes = [cfg.batch] if args.per_rank else sorted({cfg.batch, max(1, world - 1)}, reverse=True)
    for b in sizes:
        worst = check(cfg, device, b, args.per_rank)
        say(f"  check B={b}: outputs and gradients == single-process full batch (float64), max |diff| {worst:.1e}")

    # 2. training, as the seed does: the state fed back each call
    torch.manual_seed(0)
    model = build_model(cfg, device)
    ddp = wrap(model, device, args.per_rank)
    x, target = make_batch(cfg, torch.Generator().manual_seed(0), device)
    if args.per_rank:
        x, target = shard_batch((x, target))  # this rank's rows only
    say(f"  training {cfg.train_steps} steps x {cfg.reasoning_steps} RRN calls")
    losses = []
    for step in range(cfg.train_steps):
        results = reason(ddp, x, model.reset_g(x.size(0)), cfg.reasoning_steps)
        loss = loss_of(results, target, cfg.output_dim)  # gathered: the full-batch loss, the same on every rank
        (loss * ddp.loss_scale if args.per_rank else loss).backward()
        sgd_step(model, cfg.lr)
        if args.per_rank:  # for the report: the full-batch loss, from every rank's share of it
            loss = loss.detach() * ddp.loss_scale / world
            dist.all_reduce(loss)
        losses.append(loss.item())
        share = ddp.share
        assert share is not None  # set by the forward above
        say(
            f"  step {step + 1}: loss {loss.item():.4f}   (rank 0 ran rows {share.start}:{share.stop} "
            f"of {share.batch_size})"
        )

    # 3. the replicas stayed identical (DDP's all-reduce) and every rank saw the same loss
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()] + [torch.tensor(losses, device=device)])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = bool(torch.equal(flat, ref))
    ok = torch.tensor([int(same)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    passed = bool(ok.item()) and losses[-1] < losses[0]
    say(
        f"[ddp_rrn] {'PASS' if passed else 'FAIL'}: exact vs single process, loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}, parameters identical on all {world} ranks"
    )
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
