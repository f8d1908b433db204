#!/usr/bin/env bash
# `make sanitize`: the CPU extension and the tests' C++ hooks built with AddressSanitizer and UBSan (build/sanitize,
# beside the normal build), then tests/test_ops.py, the argument, memory-safety, cost-arithmetic and kernel-walk
# tests, DistributedDataParallel's C++ check hook on gloo ranks (spawned ranks inherit the preload), and the seeded
# fuzzers of the ops (tests/fuzz_ops.py), of argument trees (tests/fuzz_structures.py) and of the entry points'
# argument parsing (tests/fuzz_entry_points.py) against it. Any sanitizer report fails the run, and is printed.
#   FUZZ_SECONDS (default 60) bounds each fuzzer (the entry points' a third), FUZZ_SEED (default 0) seeds them.
set -euo pipefail
cd "$(dirname "$0")/.."
py="$(command -v "${PY:-.venv/bin/python}")"
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute (the venv's link itself, not its target)
out="$PWD/build/sanitize"
lib="$out/lib"
mkdir -p "$out"  # a fresh tree has no build/ yet

echo "[sanitize] building the CPU extension with -fsanitize=address,undefined into $lib"
DPFAST_SANITIZE=1 DPFAST_CUDA=0 DPFAST_TEST_HOOKS=1 "$py" setup.py -q build_ext --build-lib "$lib" \
  > "$out.build.log" 2>&1 \
  || { tail -n 40 "$out.build.log"; exit 1; }
mkdir -p "$lib/dpfast"
# the package (subpackages too, nothing stale) beside the sanitized _C, so nothing else can be imported instead
find "$lib/dpfast" -name '*.py' -delete
(cd dpfast && find . -name '*.py' -exec cp --parents {} "$lib/dpfast/" \;)
log="$out/run.log"
: > "$log"

# Uninstrumented code (libtorch, Python) shares the process: leaks and new/delete pairing are theirs, not ours.
# A huge allocation is a clean error (torch raises), not a report.
export ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:allocator_may_return_null=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# Python objects from the C allocator, not Python's own pools: our code reading a freed one is then a report
export PYTHONMALLOC=malloc
# The sanitizer runtime must be the first library loaded, before python's own. Reports go to stderr, kept in $log;
# the allocator's warning for each refused huge allocation (allocator_may_return_null) is dropped.
run() {
  LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" PYTHONPATH="$lib" "$@" \
    2>&1 | sed -u '/AddressSanitizer failed to allocate/d' | tee -a "$log"
}
loaded=$(cd "$out" && run "$py" -c "import dpfast._C as C; print(C.__file__)")  # not from the source tree
case "$loaded" in
  "$lib"/*) echo "[sanitize] testing $loaded" ;;
  *) echo "[sanitize] the sanitized extension was not the one imported ($loaded)"; exit 1 ;;
esac

status=0
# pytest's console script, not `python -m pytest`: that would put the source tree (and its normal build) first;
# --capture=sys leaves file descriptor 2 alone, so a report from a test that aborts the process is not lost
run "$(dirname "$py")/pytest" -q -p no:cacheprovider --capture=sys tests/test_ops.py tests/test_op_arguments.py \
  tests/test_memory_safety.py tests/test_native_costs.py tests/test_balance.py \
  tests/test_cuda_decisions_on_host.py tests/test_ddp_check_hook.py tests/test_distributed_checks.py \
  tests/test_distributed_step_records.py tests/test_shallow_snapshots.py tests/test_replica_bindings.py tests/test_replica_leases.py || status=$?
run "$py" tests/fuzz_ops.py --seconds "${FUZZ_SECONDS:-60}" --seed "${FUZZ_SEED:-0}" || status=$?
run "$py" tests/fuzz_structures.py --seconds "${FUZZ_SECONDS:-60}" --seed "${FUZZ_SEED:-0}" || status=$?
run "$py" tests/fuzz_entry_points.py --seconds "$(( ${FUZZ_SECONDS:-60} / 3 + 1 ))" --seed "${FUZZ_SEED:-0}" || status=$?

# the tests capture their subprocesses' stderr: a report there fails the test, and shows in its output here
if grep -E -q "ERROR: AddressSanitizer|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$log"; then
  echo "[sanitize] sanitizer reports (full output: $log):"
  grep -E -A 12 "ERROR: AddressSanitizer|runtime error:" "$log" | head -n 200
  exit 1
fi
[ "$status" = 0 ] && echo "[sanitize] no sanitizer report, all tests and the fuzzer passed"
exit "$status"
