"""``python -m dpfast info | demo | bench``: what was built, the seed models under dpfast, the benchmarks.

* ``info``  — torch and CUDA versions, visible devices, whether ``dpfast._C`` loaded, which kernels were compiled
  (and why), and whether the compiled CUDA architectures cover the visible GPUs.
* ``demo``  — runs the three examples built on the two seed models: ``examples/rrn.py`` (seed 000) and
  ``examples/transformer.py`` (seed 004), each with the seed's own error (quoted from its report), the
  ``ScatterError`` dpfast raises without a spec and its plan with the one-line spec; ``examples/rrn_fused_state.py``
  (seed 000 rewritten with a batch-first state, which needs no spec), with its plan. Each then trains a few steps
  and checks in float64 that outputs and gradients equal the unwrapped model's. Exits non-zero if any check fails.
  Without a GPU it rehearses a 4-GPU run on the CPU.
* ``bench`` — runs ``benchmarks/bench_ops.py`` and ``benchmarks/bench_dp.py`` (``bench ops ...`` / ``bench dp ...``
  for one of them); further arguments are passed to each script's ``main(argv)``.

The examples and benchmarks are the files in a checkout's ``examples/`` and ``benchmarks/`` (when dpfast is imported
from a checkout), else the installed package's copies, ``dpfast.examples`` and ``dpfast.benchmarks``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from .ext.loader import _IN_CHECKOUT, _rebuild_command

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
# A checkout's own files, even where another dpfast (an editable install elsewhere) is also importable
EXAMPLES_DIR = SOURCE_ROOT / "examples" if _IN_CHECKOUT else PACKAGE_DIR / "examples"
BENCHMARKS_DIR = SOURCE_ROOT / "benchmarks" if _IN_CHECKOUT else PACKAGE_DIR / "benchmarks"

# (module in examples/, what it shows)
EXAMPLES = [
    ("rrn", "seed 000: RRN, LSTM state (L, B, H): in_dims={'h': 1}, out_dims=(0, 0, 1)"),
    ("transformer", "seed 004: Transformer, (T, T) tgt_mask: in_dims={'tgt_mask': None}, out_dims=1"),
    ("rrn_fused_state", "seed 000 rewritten: batch-first state via dpfast.ops, default dim=0"),
]
BENCHMARKS = [("ops", "bench_ops.py"), ("dp", "bench_dp.py")]
_OPS = ["transpose01", "split_contiguous", "scatter", "gather"]
_KEYS = ["CPU", "CUDA", "Autograd", "Meta"]

_EXAMPLES_PACKAGE = "dpfast.examples"


# ---- loading the examples and benchmarks ----------------------------------------------------------------------------


def load_example(name: str) -> ModuleType:
    """Import ``<EXAMPLES_DIR>/<name>.py`` as ``dpfast.examples.<name>`` (so the examples' relative imports work)."""
    if not (EXAMPLES_DIR / f"{name}.py").is_file():
        raise FileNotFoundError(
            f"{EXAMPLES_DIR / (name + '.py')} not found: dpfast's examples ship in its source tree and, as "
            "dpfast.examples, in its wheel; reinstall dpfast (pip install --no-build-isolation .)"
        )
    if _EXAMPLES_PACKAGE not in sys.modules:  # bound to EXAMPLES_DIR, whatever else sys.path could find
        spec = importlib.util.spec_from_file_location(
            _EXAMPLES_PACKAGE, EXAMPLES_DIR / "__init__.py", submodule_search_locations=[str(EXAMPLES_DIR)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[_EXAMPLES_PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{_EXAMPLES_PACKAGE}.{name}")


def _load_file(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _exit_code(result: object) -> int:
    """A script's ``main`` may return None (success), an int, or a bool."""
    if result is None:
        return 0
    if isinstance(result, bool):
        return 0 if result else 1
    if isinstance(result, int):
        return result
    return 0


# ---- info ------------------------------------------------------------------------------------------------------------


def _covers(arch_list: str | None, major: int, minor: int) -> bool | None:
    """Whether TORCH_CUDA_ARCH_LIST-style ``arch_list`` ("8.0;9.0+PTX") has code that runs on sm_<major><minor>."""
    if not arch_list:
        return None
    entries = [a.strip() for a in arch_list.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    for entry in entries:
        ptx = entry.endswith("+PTX")
        base = entry[: -len("+PTX")] if ptx else entry
        try:
            a_major, a_minor = (int(p) for p in base.split(".")[:2])
        except ValueError:
            continue
        if (a_major, a_minor) == (major, minor):
            return True
        if a_major == major and a_minor <= minor:  # same major: binaries are forward compatible within it
            return True
        if ptx and (a_major, a_minor) <= (major, minor):
            return True
    return False


def info(as_json: bool = False) -> int:
    import torch

    import dpfast

    facts = dpfast.build_info()
    if as_json:
        print(json.dumps(facts, indent=2, sort_keys=True, default=str))
        return 0
    yes = lambda v: "yes" if v else "no"  # noqa: E731
    print("dpfast", facts.get("dpfast_version"), f"({Path(dpfast.__file__).resolve().parent})")
    print()
    print("torch")
    print(
        f"  version            {facts['torch_version']} (CUDA build: {facts['torch_cuda_version'] or 'no, CPU-only'})"
    )
    print(f"  intra-op threads   {torch.get_num_threads()} (CPU cores: {os.cpu_count()})")
    print(f"  CUDA available     {yes(facts['cuda_available'])}")

    print()
    print("devices")
    print("  cpu                always (device_ids=['cpu'] * n rehearses an n-GPU run)")
    arch_list = facts.get("cuda_arch_list")
    n = facts.get("cuda_device_count") or 0
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        covered = _covers(arch_list, p.major, p.minor) if facts["cuda_kernels_compiled"] else False
        note = {
            True: "dpfast CUDA kernels: compiled for it",
            False: "dpfast CUDA kernels: NOT compiled for it",
            None: "dpfast CUDA kernels: arch list unknown",
        }[covered]
        print(f"  cuda:{i}             {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB; {note}")
    if n == 0:
        why = "torch is a CPU-only build" if not facts["torch_cuda_version"] else "no GPU visible"
        print(f"  (no CUDA device: {why}; dpfast.DataParallel without device_ids calls the module directly)")

    print()
    print("dpfast._C (the compiled extension)")
    print(f"  loaded             {yes(facts['extension_loaded'])}")
    if not facts["extension_loaded"]:
        print(f"  why not            {facts.get('extension_error')}")
        print("  effect             dpfast.ops falls back to dpfast.reference (plain PyTorch: same results, slower)")
        print(f"  to fix             {_rebuild_command()}")
    else:
        built = facts.get("built_with_torch")
        print(
            f"  built with torch   {built}"
            + (
                ""
                if not built or facts["torch_version"].startswith(str(built))
                else f"  <- differs from the running torch {facts['torch_version']}: rebuild"
            )
        )
        print(
            f"  CUDA kernels       {'compiled' if facts['cuda_kernels_compiled'] else 'not compiled'}"
            + (f" for arch {arch_list}" if facts["cuda_kernels_compiled"] and arch_list else "")
        )
        print(f"  build decision     {facts.get('build_reason') or 'not recorded'}")
        if facts.get("debug_build") is not None:
            debug = "yes" if facts["debug_build"] else "no (a release build; DPFAST_DEBUG=1 keeps it)"
            print(f"  debug info         {debug}")
        print("  kernels registered " + _registered_kernels(torch))
    print(f"  ops backend        {facts['ops_backend']}")
    if os.environ.get("DPFAST_REQUIRE_EXTENSION", "0") not in ("", "0"):
        print("  DPFAST_REQUIRE_EXTENSION is set: a missing extension is an import error")
    return 0


def _registered_kernels(torch) -> str:
    parts = []
    for op in _OPS:
        try:
            keys = [k for k in _KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(f"dpfast::{op}", k)]
        except Exception:  # noqa: BLE001 - op missing, or a torch without this private helper
            keys = ["?"]
        parts.append(f"{op} ({', '.join(keys) or 'none'})")
    return "\n                     ".join(parts)


# ---- demo ---------------------------------------------------------------------------------------------------------


def demo(devices: str = "auto", only: Sequence[str] | None = None, quiet: bool = False) -> int:
    names = [n for n, _ in EXAMPLES]
    chosen = list(only) if only else names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        print(f"dpfast demo: unknown example(s) {unknown}; choose from {names}", file=sys.stderr)
        return 2
    results = []
    for name in chosen:
        what = dict(EXAMPLES)[name]
        argv = ["--devices", devices] + (["--quiet"] if quiet else [])
        t0 = time.perf_counter()
        try:
            code = _exit_code(load_example(name).main(argv))
            error = None
        except SystemExit as exc:  # an example's argparse, or an explicit exit
            code, error = (exc.code if isinstance(exc.code, int) else 1), None
        except Exception as exc:  # noqa: BLE001 - report every example, then fail
            traceback.print_exc()
            code, error = 1, f"{type(exc).__name__}: {exc}"
        results.append((name, what, code, time.perf_counter() - t0, error))
        print(flush=True)

    print("=" * 100)
    print(f"dpfast demo: {sum(r[2] == 0 for r in results)}/{len(results)} examples passed")
    for name, what, code, seconds, error in results:
        status = "PASS" if code == 0 else "FAIL"
        print(f"  {status}  examples/{name + '.py':<20} {what}  ({seconds:.1f} s)")
        if error:
            print(f"        {error.splitlines()[0]}")
    return 0 if all(r[2] == 0 for r in results) else 1


# ---- bench --------------------------------------------------------------------------------------------------------


def bench(which: str = "all", argv: Sequence[str] = ()) -> int:
    chosen = [(key, f) for key, f in BENCHMARKS if which in ("all", key)]
    code = 0
    for key, filename in chosen:
        path = BENCHMARKS_DIR / filename
        if not path.is_file():
            print(f"dpfast bench: {path} not found, skipping benchmarks/{filename}", file=sys.stderr)
            code = code or 1
            continue
        script_argv = list(argv)
        if path.parent == PACKAGE_DIR / "benchmarks" and "--out" not in script_argv:  # not into site-packages
            script_argv += ["--out", str(Path.cwd() / "dpfast-bench-results")]
        print(f"== benchmarks/{filename} {' '.join(script_argv)}".rstrip(), flush=True)
        module = _load_file(path, f"dpfast_benchmarks_{key}")
        if not callable(getattr(module, "main", None)):
            print(f"dpfast bench: {path} has no main(argv=None) function", file=sys.stderr)
            code = code or 1
            continue
        saved_argv = sys.argv
        sys.argv = [str(path)] + script_argv  # so the script's argparse names itself in --help and errors
        try:
            result = _exit_code(module.main(script_argv))
        except SystemExit as exc:
            result = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.argv = saved_argv
        code = code or result
    return code


# ---- the command line ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dpfast",
        description="dpfast: correct single-process multi-GPU data parallelism. Commands: info, demo, bench.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{info,demo,bench}")
    sub.required = True

    p = sub.add_parser(
        "info",
        help="torch/CUDA/build facts, visible devices, what was compiled and why",
        description="Print torch and CUDA versions, visible devices, whether dpfast._C loaded, which "
        "kernels were compiled and why (dpfast.build_info()).",
    )
    p.add_argument("--json", action="store_true", help="print dpfast.build_info() as JSON")

    p = sub.add_parser(
        "demo",
        help=f"run the {len(EXAMPLES)} examples (the seed models under dpfast; exit 1 if a check fails)",
        description=f"Run the {len(EXAMPLES)} examples: "
        + "; ".join(f"{n}.py ({w})" for n, w in EXAMPLES)
        + ". rrn.py and transformer.py quote the seed's own error and print the ScatterError dpfast raises without "
        "the spec; every example prints its plan, the loss per training step, and a float64 check against the "
        "unwrapped model.",
    )
    p.add_argument(
        "--devices",
        default="auto",
        help="'auto' (every GPU if 2+; a 4-replica rehearsal on cuda:0 with one GPU; a 4-replica CPU "
        "rehearsal without a GPU), 'cpu:N', 'cuda', or ids such as '0,1' (default: %(default)s)",
    )
    p.add_argument(
        "--only", action="append", choices=[n for n, _ in EXAMPLES], help="run only this example (repeatable)"
    )
    p.add_argument("--quiet", action="store_true", help="one line per example")

    p = sub.add_parser(
        "bench",
        help="run benchmarks/bench_ops.py and benchmarks/bench_dp.py",
        description="Run benchmarks/bench_ops.py and benchmarks/bench_dp.py (or one of them); any "
        "further arguments are passed to each script's main(argv), e.g. "
        "`python -m dpfast bench ops --help`.",
    )
    p.add_argument(
        "which",
        nargs="?",
        choices=["all", "ops", "dp"],
        default="all",
        help="which benchmark to run (default: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `bench` forwards everything after it (and after `ops`/`dp`/`all`) to the scripts, `--out DIR` included:
    # argparse would take DIR for the benchmark's name. Only a bare `bench --help` is the CLI's own.
    if argv[:1] == ["bench"] and argv[1:2] not in (["-h"], ["--help"]):
        rest = argv[1:]
        which = rest.pop(0) if rest[:1] and rest[0] in ("all", "ops", "dp") else "all"
        return bench(which, rest)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "info":
        return info(as_json=args.json)
    if args.command == "demo":
        return demo(devices=args.devices, only=args.only, quiet=args.quiet)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
