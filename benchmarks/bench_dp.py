"""Training step (forward + backward) of the seed-000 RRN: plain module vs dpfast.DataParallel (vs torch's).

Variants, measured interleaved (round-robin over variants) in one run; times are medians of the rounds and ratios
medians of the per-round ratios, so they compare like with like on a noisy machine:

* ``halves``: the plain module called on the two halves of the batch in turn, one backward: the floor of any
  2-replica split on one interpreter (small batches are bound by per-op overhead, which two replicas pay twice).
* CPU (``--device cpu``): the plain module vs ``dpfast.DataParallel(model, ["cpu"] * 2, in_dims={"h": 1},
  out_dims=(0, 0, 1))``, the 2-replica CPU rehearsal. Target: dpfast <= 1.3x plain.
* CUDA (``--device cuda``): additionally ``dpfast`` on ``[0, 0]`` vs ``torch.nn.DataParallel`` on ``[0, 0]``.
  torch's DataParallel splits every input on dim 0, which is the seed's bug for the LSTM state ``(1, B, H)``, so
  torch runs the blog's fix: a thin wrapper keeping the state batch-first (``transpose(0, 1).contiguous()`` around
  the call). If torch refuses duplicate ids, its replicate + scatter + parallel_apply + gather are timed directly
  on ``[0, 0]`` instead, and the table says so. Target: dpfast <= 0.5x torch.

One step = zero the grads, one RRN call ``model(x, x, (h0, c0))``, cross-entropy on the output, ``backward()``.

More sections: the fixed cost per extra replica (``--section replicas``, benchmarks/dp_replicas.py), balanced work
with ``cost=`` (``--section balance``, benchmarks/dp_balance.py), per-leaf and per-call overhead against the same
work written by hand (``--section overhead``, benchmarks/dp_overhead.py) and ``DistributedDataParallel`` on two gloo
ranks against torch's DDP, with per-rank loading's balance (``--section ddp``, benchmarks/dp_distributed.py), and
``dpfast.distributed.fully_shard`` against torch's FSDP2 (``--section fsdp``, benchmarks/dp_sharded.py). A
diagnostic, run only when named: where a rehearsal's forward time goes, each piece timed inside the step and hot
(``--section inside``, benchmarks/dp_inside_step.py).

Prints tables, writes ``benchmarks/results/bench_dp.json`` and ``bench_dp.png`` (or ``--out DIR``).

    python benchmarks/bench_dp.py [--device cpu|cuda] [--quick]
        [--section all|rrn|replicas|balance|overhead|ddp|fsdp|inside] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if os.path.isfile(os.path.join(ROOT, "setup.py")):  # a checkout: its own dpfast
    sys.path.insert(0, ROOT)

import dpfast  # noqa: E402

sys.path.insert(0, HERE)  # the sections' modules beside this file
from _timing import measure, ratio  # noqa: E402
from dp_balance import PACKED_HIDDEN, PACKED_IN, planning_time, plot_balance, print_balance, run_balance  # noqa: E402
from dp_distributed import plot_ddp, print_ddp, run_ddp  # noqa: E402
from dp_inside_step import print_inside, run_inside  # noqa: E402
from dp_overhead import print_overhead, run_overhead  # noqa: E402
from dp_replicas import print_replicas, run_replicas  # noqa: E402
from dp_sharded import print_fsdp, run_fsdp  # noqa: E402

try:
    from dpfast.__main__ import load_example  # the checkout's examples/, or the installed dpfast.examples

    _rrn = load_example("rrn")
    IN_DIMS, OUT_DIMS, RRN = _rrn.IN_DIMS, _rrn.OUT_DIMS, _rrn.RRN  # the seed's model, unchanged
except (ImportError, FileNotFoundError):  # pragma: no cover - no examples: an equivalent small model
    IN_DIMS, OUT_DIMS = {"h": 1}, (0, 0, 1)

    class RRN(nn.Module):  # type: ignore[no-redef]
        def __init__(self, dim_hidden, message_dim, output_dim, f_dims, o_dims, device, g_layers=1):
            super().__init__()
            self.message_dim = message_dim

            def mlp(i, hs, o):
                layers, last = [], i
                for h in hs:
                    layers += [nn.Linear(last, h), nn.ReLU()]
                    last = h
                return nn.Sequential(*layers, nn.Linear(last, o))

            self.f = mlp(2 * dim_hidden, f_dims, message_dim)
            self.g_mlp = mlp(dim_hidden + message_dim, f_dims, 128)
            self.g = nn.LSTM(128, dim_hidden, num_layers=g_layers, batch_first=True)
            self.o = mlp(dim_hidden, o_dims, output_dim)

        def forward(self, x, hidden, h, edge_attribute=None):
            b, n, d = hidden.shape
            hi = hidden.repeat(1, n, 1)
            hj = hidden.unsqueeze(2).repeat(1, 1, n, 1).view(b, -1, d)
            messages = self.f(torch.cat((hi, hj), 2)).view(b, n, n, self.message_dim).sum(2)
            out, h = self.g(self.g_mlp(torch.cat((x, messages), 2)), h)
            hidden = out.clone()
            return self.o(hidden), hidden, h


# the examples' config: 5 facts, hidden 32, messages 32, MLPs (64, 64) and (64,), 4 classes
N_FACTS, HIDDEN, MESSAGE, CLASSES, F_DIMS, O_DIMS = 5, 32, 32, 4, [64, 64], [64]


class BatchFirstState(nn.Module):
    """The blog's fix for torch.nn.DataParallel: the LSTM state crosses the wrapper batch-first."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, hidden, h):
        h = tuple(t.transpose(0, 1).contiguous() for t in h)
        out, hidden, h = self.model(x, hidden, h)
        return out, hidden, tuple(t.transpose(0, 1) for t in h)


def build(device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = RRN(HIDDEN, MESSAGE, CLASSES, F_DIMS, O_DIMS, device).to(device)
    return model.eval()  # dropout off: every variant computes the same thing


def make_step(net: Callable, params: Sequence[torch.Tensor], x, target, h, state_batch_first=False):
    if state_batch_first:
        h = tuple(t.transpose(0, 1).contiguous() for t in h)

    def step():
        for p in params:
            p.grad = None
        out, _, _ = net(x, x, h)
        loss = F.cross_entropy(out.reshape(-1, CLASSES), target.reshape(-1))
        loss.backward()
        return loss

    return step


def halves_forward(model: nn.Module, x, h) -> Callable[[], torch.Tensor]:
    """The forward of :func:`halves_step`: the module on each half of the batch in turn, outputs concatenated."""
    b = x.shape[0]
    sizes = [b - b // 2, b // 2]
    xs = torch.split(x, sizes)
    hs = list(zip(*(torch.split(t, sizes, dim=1) for t in h)))
    return lambda: torch.cat([model(xi, xi, hi)[0] for xi, hi in zip(xs, hs)])


def halves_step(model: nn.Module, x, target, h):
    """The plain module called on the two halves of the batch in turn (outputs concatenated, one backward): what
    any 2-replica split costs on one interpreter before any data-parallel machinery, as small batches are bound by
    per-op overhead that two replicas pay twice."""
    params = list(model.parameters())
    forward = halves_forward(model, x, h)

    def step():
        for p in params:
            p.grad = None
        out = forward()
        loss = F.cross_entropy(out.reshape(-1, CLASSES), target.reshape(-1))
        loss.backward()
        return loss

    return step


def torch_parts_step(model: nn.Module, ids: list, x, target, h):
    """torch's DataParallel, taken apart (for when it refuses duplicate ids): replicate + scatter + parallel_apply
    + gather on ``ids``, each as torch.nn.DataParallel.forward calls it."""
    from torch.nn.parallel import gather, parallel_apply, replicate
    from torch.nn.parallel.scatter_gather import scatter_kwargs

    wrapped = BatchFirstState(model)
    hb = tuple(t.transpose(0, 1).contiguous() for t in h)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        inputs, kwargs = scatter_kwargs((x, x, hb), {}, ids, 0)
        replicas = replicate(wrapped, ids[: len(inputs)], not torch.is_grad_enabled())
        outputs = parallel_apply(replicas, inputs, kwargs, ids[: len(inputs)])
        out, _, _ = gather(outputs, ids[0], 0)
        loss = F.cross_entropy(out.reshape(-1, CLASSES), target.reshape(-1))
        loss.backward()
        return loss

    return step


def batch_inputs(batch: int, device: torch.device) -> tuple:
    """The step's ``x``, ``target`` and zero LSTM state ``(h0, c0)`` at ``batch`` (the same values every run)."""
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, N_FACTS, HIDDEN, generator=gen).to(device)
    target = torch.randint(0, CLASSES, (batch, N_FACTS), generator=gen).to(device)
    return x, target, tuple(torch.zeros(1, batch, HIDDEN, device=device) for _ in range(2))


def run_batch(batch: int, device: torch.device, budget_s: float, rounds: int, notes: list) -> dict:
    x, target, h = batch_inputs(batch, device)

    plain = build(device)
    variants = {
        "plain": make_step(plain, list(plain.parameters()), x, target, h),
        "halves": halves_step(plain, x, target, h),
    }
    ids = ["cpu"] * 2 if device.type == "cpu" else [device.index or 0] * 2
    dp_model = build(device)
    dp = dpfast.DataParallel(dp_model, ids, in_dims=IN_DIMS, out_dims=OUT_DIMS)
    variants["dpfast"] = make_step(dp, list(dp_model.parameters()), x, target, h)
    if device.type == "cuda":
        t_model = build(device)
        try:
            tdp = nn.DataParallel(BatchFirstState(t_model), ids)
            step = make_step(tdp, list(t_model.parameters()), x, target, h, state_batch_first=True)
            step()
            variants["torch"] = step
            label = "torch.nn.DataParallel"
        except Exception as exc:  # noqa: BLE001 - reported in the table
            note = f"torch.nn.DataParallel refused device_ids={ids}: {type(exc).__name__}: {exc}".splitlines()[0]
            if note not in notes:
                notes.append(note + "; timing torch's replicate+scatter+parallel_apply+gather directly")
            variants["torch"] = torch_parts_step(t_model, ids, x, target, h)
            label = "torch parts (replicate+scatter+parallel_apply+gather)"
    samples = measure(variants, device, budget_s, rounds)
    times = {k: statistics.median(v) for k, v in samples.items()}
    row = {
        "batch": batch,
        "seconds": times,
        "dpfast/plain": ratio(samples, "dpfast", "plain"),
        "halves/plain": ratio(samples, "halves", "plain"),
        "dpfast/halves": ratio(samples, "dpfast", "halves"),
    }
    if "torch" in times:
        row["torch_label"] = label
        row["torch/plain"] = ratio(samples, "torch", "plain")
        row["dpfast/torch"] = ratio(samples, "dpfast", "torch")
    return row


def plot(rows: list, device: str, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    batches = [r["batch"] for r in rows]
    for name in rows[0]["seconds"]:
        a1.plot(batches, [1e3 * r["seconds"][name] for r in rows], marker="o", label=name)
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("batch")
    a1.set_ylabel("ms per training step (median)")
    a1.set_title(f"seed-000 RRN step on {device}")
    a1.legend()
    for key in ("dpfast/plain", "halves/plain", "dpfast/torch"):
        if key in rows[0]:
            a2.plot(batches, [r[key] for r in rows], marker="o", label=key)
    a2.axhline(1.3, color="gray", ls="--", lw=1, label="target dpfast/plain 1.3")
    if "dpfast/torch" in rows[0]:
        a2.axhline(0.5, color="gray", ls=":", lw=1, label="target dpfast/torch 0.5")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("batch")
    a2.set_ylabel("ratio (lower is better)")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _save(result: dict, path: str) -> None:
    """Through a temporary file, so a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)


def print_rrn(rows: list, device: torch.device, notes: list) -> None:
    names = list(rows[0]["seconds"])
    ratio_keys = [
        k for k in ("dpfast/plain", "halves/plain", "dpfast/halves", "torch/plain", "dpfast/torch") if k in rows[0]
    ]
    header = (
        f"{'batch':>6} " + " ".join(f"{n + ' ms':>12}" for n in names) + " " + " ".join(f"{k:>13}" for k in ratio_keys)
    )
    print(
        f"seed-000 RRN training step (forward + backward), {device}, 2 replicas on one device, "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['batch']:>6} "
            + " ".join(f"{1e3 * r['seconds'][n]:>12.3f}" for n in names)
            + " "
            + " ".join(f"{r[k]:>13.3f}" for k in ratio_keys)
        )
    for note in notes:
        print("note:", note)
    if "torch_label" in rows[0]:
        print(f"torch = {rows[0]['torch_label']} on the same ids, state kept batch-first (the blog's fix)")
    if device.type == "cpu":
        met = [r["batch"] for r in rows if r["dpfast/plain"] <= 1.3]
        missed = [
            f"{r['batch']} ({r['dpfast/plain']:.2f}; halves/plain {r['halves/plain']:.2f})"
            for r in rows
            if r["dpfast/plain"] > 1.3
        ]
        print(
            f"target dpfast/plain <= 1.3 (CPU rehearsal): met at batch {met or 'none'}"
            + (f"; NOT met at {', '.join(missed)}" if missed else "")
        )
    if "dpfast/torch" in rows[0]:
        worst_t = max(r["dpfast/torch"] for r in rows)
        print(f"target dpfast/torch <= 0.5 on [0, 0]: worst {worst_t:.3f} -> {'met' if worst_t <= 0.5 else 'NOT met'}")


def _has_fsdp2() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch.distributed.fsdp._fully_shard") is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/bench_dp.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds (about 25 s on the CPU)")
    parser.add_argument(
        "--section",
        choices=["all", "rrn", "replicas", "balance", "overhead", "ddp", "fsdp", "inside"],
        default="all",
        help="rrn: the seed-000 step; replicas: fixed cost per extra replica; balance: cost=; overhead: per leaf and "
        "per call; ddp: DistributedDataParallel against torch's DDP on 2 gloo ranks; fsdp: fully_shard against "
        "torch's FSDP2 on 2 gloo ranks; inside: where the rehearsal's "
        "forward goes, each piece timed inside the step (a diagnostic, not in 'all')",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON and PNG")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_dp: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    # 10000: the seed's own batch (its error message: hidden[0] (1, 10000, 50) split into 4 x 2500)
    batches = [16, 64, 256] if args.quick else [16, 64, 128, 1024, 4096, 10000]
    budget, rounds = (1.8, 5) if args.quick else (7.0, 9)
    t0 = time.perf_counter()
    notes: list[str] = []
    rows, replica_rows, balance_rows, planning, overhead, ddp, inside = [], [], [], None, None, None, None
    fsdp = None
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_dp.json")
    if args.section in ("all", "rrn"):
        for b in batches:  # saved after every batch size: a run cut short keeps its rows
            rows.append(run_batch(b, device, budget, rounds, notes))
            print(f"batch {b}: done in {time.perf_counter() - t0:.1f} s", flush=True)
            partial = {"benchmark": "bench_dp", "complete": False, "device": str(device), "notes": notes, "rows": rows}
            _save(partial, path)
        print_rrn(rows, device, notes)
    if args.section in ("all", "replicas") and device.type == "cpu":
        replica_rows = run_replicas(budget, 3 * rounds)
        print_replicas(replica_rows)
    if args.section in ("all", "balance"):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # each chunk timed on one core, as if each replica had a device of its own
        try:
            # many variants of one step each: more rounds instead of more steps per sample
            balance_rows = [run_balance(n, 2 * budget, rounds if args.quick else 2 * rounds) for n in (2, 4)]
        finally:
            torch.set_num_threads(threads)
        planning = planning_time(rounds)
        print_balance(balance_rows, planning)
    if args.section in ("all", "overhead") and device.type == "cpu":
        overhead = run_overhead(args.quick, budget, rounds)
        print_overhead(overhead)
    if args.section in ("all", "ddp") and device.type == "cpu":  # NCCL would need a GPU per rank
        ddp = run_ddp(args.quick, budget, rounds)
        print_ddp(ddp)
    if args.section in ("all", "fsdp") and device.type == "cpu" and _has_fsdp2():
        fsdp = run_fsdp(args.quick, budget, rounds)
        print_fsdp(fsdp)
    if args.section == "inside" and device.type == "cpu":
        inside = run_inside(sys.modules[__name__], args.quick)
        print_inside(inside)

    result = {
        "benchmark": "bench_dp",
        "complete": True,
        "command": "python benchmarks/bench_dp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "intra_op_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "device": str(device),
        "model": {
            "class": f"{RRN.__module__}.{RRN.__name__}",
            "n_facts": N_FACTS,
            "dim_hidden": HIDDEN,
            "message_dim": MESSAGE,
            "f_dims": F_DIMS,
            "o_dims": O_DIMS,
            "classes": CLASSES,
        },
        "method": f"{rounds} interleaved rounds, {budget:.0f} s budget per batch size; times: medians, ratios: "
        "medians of per-round ratios",
        "notes": notes,
        "rows": rows,
        "replicas": replica_rows,
        "balance": {
            "model": {"class": "nn.LSTM over a PackedSequence", "input": PACKED_IN, "hidden": PACKED_HIDDEN},
            "rows": balance_rows,
            "planning": planning,
        },
        "overhead": overhead,
        "ddp": ddp,
        "fsdp": fsdp,
        "inside": inside,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    _save(result, path)
    pngs = [plot(rows, str(device), os.path.join(args.out, "bench_dp.png")) if rows else None]
    pngs.append(plot_balance(balance_rows, os.path.join(args.out, "bench_dp_balance.png")) if balance_rows else None)
    pngs.append(plot_ddp(ddp, os.path.join(args.out, "bench_dp_ddp.png")) if ddp else None)
    pngs = [p for p in pngs if p]
    print(f"wrote {path}" + "".join(f" and {p}" for p in pngs) + f" in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
