#!/usr/bin/env bash
# The sdist and the wheel, as a user installs them: `make dist` (the sdist, then the wheel built from the sdist
# alone, for DIST_CUDA_ARCH_LIST's architectures: unset, torch's whole list); the wheel installed with its extras in a
# fresh venv, where pip resolves torch against the wheel's pin; then, from outside any source tree, the test suite
# (the sdist's copy), `python -m dpfast info`, `demo` and `bench`, all against the installed package.
#   PY: the dev venv's python (makes the dist); PYTHON: the interpreter for the fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
py="${PY:-.venv/bin/python}"
work="$repo/build/ci/dist"
rm -rf "$work" dist
mkdir -p "$work/elsewhere"

step() { echo "[check_dist] $*"; }
fail() { echo "[check_dist] FAILED: $*"; exit 1; }

step "make dist: the sdist, and the wheel built from it"
make dist PY="$py"
sdist=$(ls dist/dpfast-*.tar.gz)
wheel=$(ls dist/dpfast-*.whl)
torch_version=$("$py" -c "import torch; print(torch.__version__.split('+')[0])")
# to a file first: `grep -q` stops reading at the match, and under pipefail unzip's SIGPIPE (a METADATA longer than
# the pipe's 64 KiB, README included) would fail the step
unzip -p "$wheel" '*.dist-info/METADATA' > "$work/METADATA"
grep -qx "Requires-Dist: torch==${torch_version%.*}.\*" "$work/METADATA" \
  || fail "the wheel does not pin torch ${torch_version%.*}.*"

step "a fresh venv: pip install the wheel with its extras (pip picks the torch the wheel pins)"
"${PYTHON:-python3}" -m venv "$work/venv"
v="$work/venv/bin"
"$v/pip" install -q "$wheel[test,bench]"

step "the test suite, from outside the tree, against the installed package"
tar xzf "$sdist" -C "$work"
tests=$(ls -d "$work"/dpfast-*/tests)
cd "$work/elsewhere"
where=$("$v/python" -c "import dpfast; print(dpfast.__file__)")
case "$where" in
  "$work/venv/"*) ;;
  *) fail "dpfast was imported from $where, not from the venv" ;;
esac
DPFAST_REQUIRE_EXTENSION=1 "$v/python" -m pytest -q -p no:cacheprovider "$tests"

step "python -m dpfast info | demo | bench, installed"
"$v/python" -m dpfast info | tee "$work/info.txt"
grep -q "build decision     DPFAST_CUDA=" "$work/info.txt" || fail "info does not show the build decision"
"$v/python" -m dpfast demo --quiet
"$v/python" -m dpfast bench --quick --out "$work/bench"
ls "$work/bench"/bench_ops_*.json "$work/bench"/bench_dp.json > /dev/null
# the venv is a full torch install (GBs): the next stage needs the disk more than anyone needs it kept
rm -rf "$work/venv"
step "passed"
