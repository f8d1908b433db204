#!/usr/bin/env bash
# GPU validation in one go (issue "GPU validation"): build the extension on the GPU machine, run the CUDA tests
# and both benchmarks on cuda, and keep every log and JSON under the output folder. Budget: under 8 minutes.
#   bash benchmarks/gpu_check.sh OUT_DIR          (rehearse without a GPU: DPFAST_GPU_CHECK_DRY=1)
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" DPFAST_CUDA=1 DPFAST_REQUIRE_EXTENSION=1
export MAX_JOBS="${MAX_JOBS:-16}"
step() { echo "== $1 ($(date +%T))" | tee -a "$out/summary.txt"; }

step "environment"
{ nvidia-smi || true; $py -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"; } \
  > "$out/env.txt" 2>&1
step "build"
timeout 300 $py -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1
echo "build rc=$?" | tee -a "$out/summary.txt"
$py -m dpfast info > "$out/info.txt" 2>&1

if [ "${DPFAST_GPU_CHECK_DRY:-0}" = 1 ]; then
  echo "dry run: skipping GPU tests and benchmarks" | tee -a "$out/summary.txt"
  exit 0
fi

step "cuda tests"
timeout 150 $py -m pytest -q -m cuda -p no:cacheprovider tests > "$out/tests_cuda.log" 2>&1
echo "cuda tests rc=$? : $(tail -n 1 "$out/tests_cuda.log")" | tee -a "$out/summary.txt"
step "ops tests on cuda (device-parametrized)"
timeout 120 $py -m pytest -q -k cuda -p no:cacheprovider tests/test_ops.py > "$out/tests_ops_cuda.log" 2>&1
echo "ops tests rc=$? : $(tail -n 1 "$out/tests_ops_cuda.log")" | tee -a "$out/summary.txt"
step "bench_ops (clone = device-to-device copy ceiling)"
timeout 90 $py benchmarks/bench_ops.py --device cuda --out "$out" > "$out/bench_ops.txt" 2>&1
echo "bench_ops rc=$?" | tee -a "$out/summary.txt"
step "bench_dp"
timeout 90 $py benchmarks/bench_dp.py --device cuda --out "$out" > "$out/bench_dp.txt" 2>&1
echo "bench_dp rc=$?" | tee -a "$out/summary.txt"
step "done"
