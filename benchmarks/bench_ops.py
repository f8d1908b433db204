"""Fused ops vs plain PyTorch vs a clone of the same bytes (the copy ceiling).

Each size is measured with the variants interleaved (round-robin); times are medians over rounds and ratios are
medians of the per-round ratios, so they compare like with like even on a noisy machine. Prints a table, writes
benchmarks/results/bench_ops.json and a PNG.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isfile(os.path.join(os.path.dirname(HERE), "setup.py")):  # a checkout: its own dpfast
    sys.path.insert(0, os.path.dirname(HERE))

import dpfast  # noqa: E402
from dpfast import ops  # noqa: E402


def _timer(device: str) -> Callable[[Callable[[], object], int], float]:
    if device == "cuda":

        def run(fn, iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
    else:

        def run(fn, iters):
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t) / iters

    return run


def measure(
    variants: dict[str, Callable[[], object]], device: str, budget_s: float, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant in every round; variants alternate within a round, so a round's variants
    share the machine's state and their ratio is meaningful even when the machine's speed drifts."""
    timer = _timer(device)
    for fn in variants.values():  # warm up (allocator, thread pool, kernel caches)
        fn()
    probe = min(timer(fn, 1) for fn in variants.values())
    iters = max(1, int(budget_s / rounds / len(variants) / max(probe, 1e-7)))
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(timer(fn, iters))
    return samples


def ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of a's time over b's in the same round."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def cases(device: str, quick: bool):
    """(op, label, bytes moved, variants) for every benchmarked configuration."""
    H = 128
    batches = [8, 64, 512, 4096, 32768, 131072] if quick else [8, 32, 64, 128, 512, 2048, 8192, 32768, 131072, 262144]
    for B in batches:
        h = torch.randn(2, B, H, device=device)
        c = torch.randn(2, B, H, device=device)
        nbytes = 2 * h.numel() * h.element_size()
        yield (
            "transpose01(h, c)",
            f"2x(2,{B},{H})",
            nbytes,
            {
                "dpfast": lambda h=h, c=c: ops.transpose01(h, c),
                "torch": lambda h=h, c=c: [x.permute(1, 0, 2).contiguous() for x in (h, c)],
                "clone": lambda h=h, c=c: (h.clone(), c.clone()),
            },
        )
    for rows in [256, 4096, 32768] if quick else [64, 256, 1024, 4096, 16384, 65536]:
        x = torch.randn(rows, 1024, device=device)
        sizes = [256, 256, 256, 256]
        nbytes = x.numel() * x.element_size()
        yield (
            "split_contiguous(dim=1, 4 parts)",
            f"({rows},1024)",
            nbytes,
            {
                "dpfast": lambda x=x, sizes=sizes: ops.split_contiguous([x], 1, sizes),
                "torch": lambda x=x, sizes=sizes: [p.contiguous() for p in torch.split(x, sizes, 1)],
                "clone": lambda x=x: x.clone(),
            },
        )
        parts = [p.contiguous() for p in torch.split(x, sizes, 1)]
        yield (
            "gather(dim=1, 4 parts)",
            f"({rows},1024)",
            nbytes,
            {
                "dpfast": lambda parts=parts: ops.gather(parts, 1, device),
                "torch": lambda parts=parts: torch.cat(parts, 1),
                "clone": lambda x=x: x.clone(),
            },
        )

    # channels_last batches (B, C, H, W): DataParallel scatters the NHWC view (contiguous) and views each chunk back,
    # so the fused op's path is the contiguous one; the plain-PyTorch way copies each chunk in its format
    cpu = torch.device(device)
    for B in [8, 64] if quick else [8, 32, 64, 256]:
        x = torch.randn(B, 64, 28, 28, device=device).contiguous(memory_format=torch.channels_last)
        sizes = [B // 4] * 4
        nbytes = x.numel() * x.element_size()
        cl = torch.channels_last
        yield (
            "scatter(dim=0, 4 parts) channels_last",
            f"({B},64,28,28)",
            nbytes,
            {
                "dpfast": lambda x=x, sizes=sizes: [
                    c.permute(0, 3, 1, 2) for c in ops.scatter([x.permute(0, 2, 3, 1)], 0, sizes, [cpu] * 4)[0]
                ],
                "torch": lambda x=x, sizes=sizes: [p.clone() for p in torch.split(x, sizes, 0)],  # keeps the format
                "clone": lambda x=x: x.clone(),
            },
        )
        parts = [p.contiguous(memory_format=cl) for p in torch.split(x, sizes, 0)]
        yield (
            "gather(dim=0, 4 parts) channels_last",
            f"({B},64,28,28)",
            nbytes,
            {
                "dpfast": lambda parts=parts: ops.gather([p.permute(0, 2, 3, 1) for p in parts], 0, device).permute(
                    0, 3, 1, 2
                ),
                "torch": lambda parts=parts: torch.cat(parts, 0),
                "clone": lambda x=x: x.clone(),
            },
        )


_PY_OP = None


def _python_registered_op():
    """The same kernel behind an op registered from Python (torch.library.custom_op), registered once."""
    global _PY_OP
    if _PY_OP is None:

        @torch.library.custom_op("dpfast_bench::transpose01_py", mutates_args=())
        def transpose01_py(xs: list[torch.Tensor]) -> list[torch.Tensor]:
            return list(ops.transpose01(*xs))

        transpose01_py.register_fake(lambda xs: [x.new_empty((x.shape[1], x.shape[0], *x.shape[2:])) for x in xs])
        transpose01_py.register_autograd(lambda ctx, grads: list(ops.transpose01(*grads)))
        _PY_OP = transpose01_py
    return _PY_OP


def call_overhead(device: str, budget_s: float) -> dict[str, float]:
    """Seconds per call of transpose01 on a tiny (h, c), where the call path is all there is, by entry point."""
    h, c = torch.randn(2, 1, 4, device=device), torch.randn(2, 1, 4, device=device)
    boxed = torch.ops.dpfast.transpose01.default if dpfast.build_info()["extension_loaded"] else None

    transpose01_py = _python_registered_op()
    variants = {
        "dpfast.transpose01 (direct C entry)": lambda: ops.transpose01(h, c),
        "torch.ops.dpfast.transpose01 (boxed)": (lambda: boxed([h, c])) if boxed else None,
        "custom op registered from Python": lambda: transpose01_py([h, c]),
        "two clones": lambda: (h.clone(), c.clone()),
        "torch permute+contiguous pair": lambda: [x.permute(1, 0, 2).contiguous() for x in (h, c)],
    }
    samples = measure({k: v for k, v in variants.items() if v is not None}, device, budget_s, rounds=15)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="fewer sizes and shorter runs")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for JSON and PNG")
    p.add_argument("--budget", type=float, default=None, help="seconds per configuration")
    p.add_argument("--only", default=None, help="run only the ops whose name contains this text")
    args = p.parse_args(argv)
    budget = args.budget or (0.15 if args.quick else 0.8)
    rows = []
    header = (
        f"{'op':34} {'shape':>18} {'MB':>9} {'dpfast us':>10} {'torch us':>10} {'clone us':>10} "
        f"{'GB/s':>7} {'/clone':>7} {'/torch':>7}"
    )
    print(f"dpfast bench_ops on {args.device}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    print(header)
    print("-" * len(header))
    result = {
        "bench": "ops",
        "device": args.device,
        "complete": False,  # true once every row and the call overhead are in: a run cut short keeps its rows
        "device_name": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "build_info": dpfast.build_info(),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_ops_{args.device}.json")
    for op, label, nbytes, variants in cases(args.device, args.quick):
        if args.only and args.only not in op:
            continue
        samples = measure(variants, args.device, budget, rounds=7 if args.quick else 15)
        t = {k: statistics.median(v) for k, v in samples.items()}
        row = {
            "op": op,
            "shape": label,
            "bytes": nbytes,
            "seconds": t,
            "gbps": {k: 2 * nbytes / v / 1e9 for k, v in t.items()},  # read + write
            "ratio_vs_clone": ratio(samples, "dpfast", "clone"),
            "ratio_vs_torch": ratio(samples, "dpfast", "torch"),
        }
        rows.append(row)
        print(
            f"{op:34} {label:>18} {nbytes / 1e6:9.3f} {t['dpfast'] * 1e6:10.1f} {t['torch'] * 1e6:10.1f} "
            f"{t['clone'] * 1e6:10.1f} {row['gbps']['dpfast']:7.2f} {row['ratio_vs_clone']:7.2f} "
            f"{row['ratio_vs_torch']:7.2f}",
            flush=True,
        )
        _save(result, path)
    overhead = call_overhead(args.device, budget)
    print("\ncall path: transpose01 of a tiny (h, c), 2x(2,1,4)")
    for name, sec in overhead.items():
        print(f"  {name:40} {sec * 1e6:7.2f} us")
    result.update(call_overhead_seconds=overhead, complete=True)
    _save(result, path)
    print(f"wrote {path}")
    _plot(rows, os.path.join(args.out, f"bench_ops_{args.device}.png"), args.device)
    return result


def _save(result: dict, path: str) -> None:
    """Written after every row (through a temporary file, so a reader never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def _plot(rows: list[dict], path: str, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    ops_seen = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops_seen), figsize=(5 * len(ops_seen), 4), squeeze=False)
    for ax, op in zip(axes[0], ops_seen):
        mine = [r for r in rows if r["op"] == op]
        for variant in ("dpfast", "torch", "clone"):
            ax.plot([r["bytes"] for r in mine], [r["gbps"][variant] for r in mine], marker="o", label=variant)
        ax.set_xscale("log")
        ax.set_xlabel("bytes moved")
        ax.set_ylabel("GB/s (read + write)")
        ax.set_title(op, fontsize=9)
        ax.legend()
    fig.suptitle(f"dpfast fused ops on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
