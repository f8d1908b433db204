"""A rehearsal's bookkeeping counted, not timed: instructions and simulated cache misses per training step of the
seed-000 RRN at ``B = 64`` on ``["cpu"] * 2``, against its two halves run in turn, under valgrind's cachegrind.

Why: on the 2-core virtual machines this project is measured on, the same code reads 1.06-1.27x the halves from
one run to the next, so a change worth 1-2 % of a step cannot be seen in a ratio of times. Cachegrind runs the
program on a simulated CPU (one thread, a 32 KiB L1 and, as set here, a 512 KiB last level like a core's L2): its
instruction counts repeat within 0.1 % from run to run (one thread, one string hash seed; the misses move a little
with memory addresses), and the misses count what the bookkeeping's cold start costs (benchmarks/RESULTS.md,
"where a rehearsal's bookkeeping time goes"). It is slow (valgrind runs Python about 50x slower: some 10 minutes on
two cores for the default 50 steps) and needs valgrind, so it is not part of ``bench_dp.py``.

Each variant runs twice, with 0 and with ``--steps`` steps after the same warm-up, so that what the process does
once (importing torch, building the model and the wrapper) cancels out of the per-step figures.

    python benchmarks/dp_instructions.py [--steps 50] [--tree DIR] [--out DIR]

``--tree``: a checkout of another commit whose ``dpfast`` (with its extension built or copied in) is imported
instead of the installed one: the before of a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
COUNTS = {"instructions": "I   refs", "L1 data misses": "D1  misses", "last-level data misses": "LLd misses"}


def _step(which: str, steps: int) -> None:
    """The child: ``steps`` training steps of one variant after five warm-up steps (run under valgrind)."""
    import torch

    import dpfast  # (first: bench_dp puts its own checkout first on the path, which would shadow --tree's)

    torch.set_num_threads(1)  # (valgrind runs one thread at a time anyway)
    sys.path.insert(0, HERE)
    import bench_dp

    print(f"dpfast from {os.path.dirname(dpfast.__file__)}", file=sys.stderr)

    x, target, h = bench_dp.batch_inputs(64, torch.device("cpu"))
    model = bench_dp.build(torch.device("cpu"))
    if which == "dpfast":
        dp = dpfast.DataParallel(model, ["cpu"] * 2, in_dims=bench_dp.IN_DIMS, out_dims=bench_dp.OUT_DIMS)
        step = bench_dp.make_step(dp, list(model.parameters()), x, target, h)
    else:
        step = bench_dp.halves_step(model, x, target, h)
    for _ in range(5 + steps):
        step()


def _counted(which: str, steps: int, tree: str | None) -> dict[str, int]:
    """The totals cachegrind reports for one child process."""
    # one thread everywhere (a BLAS or OpenMP pool's idle threads spin, and their instructions vary by run) and one
    # string hash (a process's own hash seed changes how many probes its dict lookups take)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind", "--tool=cachegrind", "--cache-sim=yes", "--LL=524288,8,64",
            f"--cachegrind-out-file={tmp}/out", sys.executable, __file__, "--child", which, str(steps),
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{which} ({steps} steps) failed under valgrind:\n{done.stderr[-2000:]}")
    where = re.search(r"dpfast from (.+)", done.stderr)
    if tree and (where is None or not where.group(1).startswith(os.path.abspath(tree))):
        raise RuntimeError(f"--tree {tree}: the child imported dpfast from {where and where.group(1)}, not the tree")
    counts = {}
    for name, label in COUNTS.items():
        match = re.search(rf"{re.escape(label)}:\s+([\d,]+)", done.stderr)
        if match is None:
            raise RuntimeError(f"no '{label}' line in valgrind's report:\n{done.stderr[-2000:]}")
        counts[name] = int(match.group(1).replace(",", ""))
    return counts


def run(steps: int, tree: str | None) -> dict:
    """Per-step counts of both variants and of dpfast over the halves."""
    runs = [(w, n) for w in ("dpfast", "halves") for n in (0, steps)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        totals = dict(zip(runs, pool.map(lambda r: _counted(*r, tree), runs)))
    per_step = {
        w: {k: (totals[(w, steps)][k] - totals[(w, 0)][k]) / steps for k in COUNTS} for w in ("dpfast", "halves")
    }
    extra = {k: per_step["dpfast"][k] - per_step["halves"][k] for k in COUNTS}
    ratio = {k: per_step["dpfast"][k] / per_step["halves"][k] for k in COUNTS}
    return {"steps": steps, "tree": tree, "per step": per_step, "dpfast - halves": extra, "dpfast / halves": ratio}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/dp_instructions.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="counted steps per variant (default 50)")
    parser.add_argument("--tree", help="import dpfast from this checkout instead (a before)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.child:
        if args.child[0] not in ("dpfast", "halves"):
            parser.error(f"--child takes dpfast or halves, got {args.child[0]!r}")
        _step(args.child[0], int(args.child[1]))
        return 0
    result = run(args.steps, args.tree)
    print(f"\nRRN B = 64 on ['cpu'] * 2 under cachegrind, per training step ({args.steps} steps counted)")
    print(f"  {'':26s} {'dpfast':>14s} {'halves':>14s} {'dpfast - halves':>16s} {'ratio':>7s}")
    for k in COUNTS:
        d, hv = result["per step"]["dpfast"][k], result["per step"]["halves"][k]
        print(f"  {k:26s} {d:14,.0f} {hv:14,.0f} {result['dpfast - halves'][k]:16,.0f} {d / hv:7.3f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dp_instructions.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
