#!/usr/bin/env bash
# GPU validation in one command that fits a 600 s device call: check the dependencies, build the extension in
# place, run every CUDA test (marked and [cuda]-parametrized, in all files), a compute-sanitizer memcheck pass over
# the CUDA op tests, then the benchmarks. Each step has its own timeout, all of them together at most
# DPFAST_GPU_CHECK_BUDGET seconds (default 540), and each writes its log and a line of summary.txt as soon as it
# ends, so a run cut short keeps everything done so far.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [STEP...]     steps: deps build tests memcheck bench_ops bench_dp
#   DPFAST_GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh OUT_DIR   rehearsal without a GPU: deps and build run,
#       the GPU steps only collect their tests and print their commands.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_check.sh OUT_DIR [STEP...]" >&2; exit 2; }
mkdir -p "$1" && out="$(cd "$1" && pwd)" || exit 2  # absolute: the script changes directory below
shift
steps="${*:-deps build tests memcheck bench_ops bench_dp}"
cd "$(dirname "$0")/.." || exit 2
py="${PYTHON:-$(command -v python3 || command -v python)}"
[ -n "$py" ] || { echo "no python3 or python on PATH; set PYTHON" >&2; exit 2; }
dry="${DPFAST_GPU_CHECK_DRY:-0}"
budget="${DPFAST_GPU_CHECK_BUDGET:-540}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" DPFAST_CUDA=1 DPFAST_REQUIRE_EXTENSION=1 DPFAST_TEST_HOOKS=1
export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 8)}" PYTHONDONTWRITEBYTECODE=1
summary="$out/summary.txt"
start=$SECONDS
failed=""

note() { echo "$*" | tee -a "$summary"; }
has() { case " $steps " in *" $1 "*) return 0 ;; esac; return 1; }

# step NAME LIMIT CMD...: runs CMD with its output in OUT/NAME.log, under the smaller of LIMIT and what is left
# of the budget; notes the exit status and the log's last line.
step() {
  local name="$1" limit="$2" left rc t0=$SECONDS
  shift 2
  left=$((budget - (SECONDS - start)))
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -lt 10 ]; then
    note "== $name: skipped, the ${budget}s budget is spent"
    failed="$failed $name(no-time)"
    return 124
  fi
  note "== $name ($(date +%T), limit ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && note "   TIMED OUT after ${limit}s"
  note "   $name rc=$rc in $((SECONDS - t0))s: $(tail -n 1 "$out/$name.log")"
  [ $rc -eq 0 ] || failed="$failed $name"
  return $rc
}

sanitizer="$(command -v compute-sanitizer || true)"
for root in "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -z "$sanitizer" ] && [ -n "$root" ] && [ -x "$root/bin/compute-sanitizer" ] && sanitizer="$root/bin/compute-sanitizer"
done
if [ -z "$sanitizer" ] && command -v nvcc > /dev/null; then  # nvcc may be a wrapper: its dry run names the toolkit
  top="$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)"
  [ -n "$top" ] && [ -x "$top/compute-sanitizer/compute-sanitizer" ] && sanitizer="$top/compute-sanitizer/compute-sanitizer"
  [ -n "$top" ] && [ -x "$top/bin/compute-sanitizer" ] && sanitizer="$top/bin/compute-sanitizer"
fi

note "gpu_check $(date '+%F %T'): python $py, steps: $steps, budget ${budget}s$([ "$dry" = 1 ] && echo ', DRY RUN')"

if has deps; then
  # Required: torch (a CUDA build), pytest, hypothesis (the tests import it), a CUDA compiler. Optional: ninja
  # (faster build), matplotlib (plots), expecttest (torch.library.opcheck imports torch.testing._internal, which
  # imports it: a stub that only makes that import work is put on PYTHONPATH when it is missing).
  step deps 30 "$py" - "$out" << 'EOF'
import importlib, os, shutil, subprocess, sys
out = sys.argv[1]
missing, optional = [], []
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    if torch.version.cuda is None:
        missing.append("a CUDA build of torch")
except Exception as e:
    missing.append(f"torch ({e})")
for mod in ("pytest", "hypothesis"):
    try:
        print(mod, importlib.import_module(mod).__version__)
    except Exception:
        missing.append(mod)
for mod in ("expecttest", "ninja", "matplotlib", "numpy", "setuptools", "pybind11"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception:
        optional.append(mod)
nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
if nvcc and os.path.exists(nvcc):
    print(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
else:
    missing.append("nvcc (put it on PATH or set CUDA_HOME)")
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"], check=False)
else:
    print("nvidia-smi: not found")
if "expecttest" in optional:
    os.makedirs(os.path.join(out, "stubs"), exist_ok=True)
    with open(os.path.join(out, "stubs", "expecttest.py"), "w") as f:
        f.write('"""Stand-in written by gpu_check.sh: expecttest is not installed."""\nimport unittest\n\n\n'
                "class TestCase(unittest.TestCase):\n    pass\n")
print("optional, missing:", ", ".join(optional) or "none",
      "(expecttest: a stub on PYTHONPATH lets opcheck import)" if "expecttest" in optional else "")
if missing:
    print("REQUIRED, missing:", ", ".join(missing))
    sys.exit(1)
print("dependencies: ok")
EOF
  rc=$?
  if [ $rc -ne 0 ]; then
    note "stopping: a required dependency is missing (see $out/deps.log)"
    exit 1
  fi
fi
[ -f "$out/stubs/expecttest.py" ] && export PYTHONPATH="$out/stubs${PYTHONPATH:+:$PYTHONPATH}"
note "   compute-sanitizer: ${sanitizer:-NOT FOUND (the memcheck step will be skipped)}"

if has build; then
  # In place (no pip): setuptools older than 77 cannot read pyproject.toml's license string, which any setup.py
  # command reads; then the extension is built again through a Distribution that skips pyproject.toml.
  build() {
    "$py" setup.py build_ext --inplace && return 0
    "$py" -c "import setuptools; v = setuptools.__version__; exit(int(v.split('.')[0]) >= 77)" || return 1
    echo "setuptools $("$py" -c 'import setuptools; print(setuptools.__version__)') < 77: building without pyproject.toml"
    "$py" -c "
import sys; sys.path.insert(0, '.')
import setup, torch
from setuptools import Distribution
exts, record = setup.extensions(torch)
d = Distribution({'name': 'dpfast', 'packages': ['dpfast'], 'ext_modules': exts,
                  'cmdclass': {'build_ext': setup.build_ext_class(record)}, 'script_args': ['build_ext', '--inplace']})
d.parse_command_line()
d.run_commands()"
  }
  export py
  export -f build
  if ! step build 210 bash -c build; then
    tail -n 40 "$out/build.log"
    note "stopping: the build failed (log: $out/build.log)"
    exit 1
  fi
  if ! step info 15 "$py" -m dpfast info; then  # built but not importable (DPFAST_REQUIRE_EXTENSION=1)
    tail -n 20 "$out/info.log"
    note "stopping: dpfast._C does not load (log: $out/info.log)"
    exit 1
  fi
fi

pytest=(-m pytest -p no:cacheprovider --continue-on-collection-errors -rfEs)
# The sanitizer pass: the CUDA op tests that launch dpfast's kernels on many shapes, widths, alignments and job
# counts, without the big copies (slow under memcheck), the timing test and graphs (torch's caching allocator is
# off so that memcheck sees each allocation's bounds).
memcheck_k="cuda and not past_2_32 and not large_copies and not pinned_memory_returns and not graph and not two_gpus"
memcheck_tests=(tests/test_cuda_on_gpu.py "tests/test_ops.py::test_cuda_many_jobs_staged_path"
  "tests/test_ops.py::test_many_dims_take_the_fallback_path" "tests/test_ops.py::test_negative_dim_wraps_per_tensor")

if [ "$dry" = 1 ]; then
  has tests && step tests 60 "$py" "${pytest[@]}" -q --collect-only -k cuda tests
  if has memcheck; then
    step memcheck 60 "$py" "${pytest[@]}" -q --collect-only -k "$memcheck_k" "${memcheck_tests[@]}"
    note "   would run: PYTORCH_NO_CUDA_MEMORY_CACHING=1 ${sanitizer:-compute-sanitizer} --tool memcheck ... pytest"
  fi
  has bench_ops && note "== bench_ops: would run $py benchmarks/bench_ops.py --device cuda --quick --out $out"
  has bench_dp && note "== bench_dp: would run $py benchmarks/bench_dp.py --device cuda --quick --out $out"
  note "dry run done in $((SECONDS - start))s; failed steps:${failed:- none}"
  [ -z "$failed" ]
  exit
fi

has tests && step tests 130 "$py" "${pytest[@]}" -v --durations=15 -k cuda tests
if has memcheck; then
  if [ -n "$sanitizer" ]; then
    step memcheck 90 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --error-exitcode 99 \
      --print-limit 20 "$py" "${pytest[@]}" -q -x -k "$memcheck_k" "${memcheck_tests[@]}"
  else
    note "== memcheck: skipped, compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)"
  fi
fi
has bench_ops && step bench_ops 30 "$py" benchmarks/bench_ops.py --device cuda --quick --out "$out"
has bench_dp && step bench_dp 30 "$py" benchmarks/bench_dp.py --device cuda --quick --out "$out"
note "done in $((SECONDS - start))s; logs and JSON in $out; failed steps:${failed:- none}"
[ -z "$failed" ]
