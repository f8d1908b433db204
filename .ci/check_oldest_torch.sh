#!/usr/bin/env bash
# The oldest supported torch, 2.4, in a venv of its own: `pip install --no-build-isolation -e .` with a setuptools
# older than 77 must stop with what to install; plain `pip install .` (build isolation) must build CPU-only against
# the venv's torch 2.4, not one pip downloads (with the tests' C++ hooks, so that their tests run on 2.4's headers
# too); then the whole suite, from outside the tree, against that install (tests of features that need a newer
# torch skip, saying which).
#   PYTHON: the interpreter for the venv; TORCH_OLDEST: the torch to install (default 2.4.0).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
work="$repo/build/ci/oldest-torch"
rm -rf "$work"
mkdir -p "$work/elsewhere"
v="$work/venv/bin"

step() { echo "[check_oldest_torch] $*"; }
fail() { echo "[check_oldest_torch] FAILED: $*"; exit 1; }

step "venv with torch ${TORCH_OLDEST:-2.4.0} (PyPI's is a CUDA 12 build; its nvidia libraries load at import)"
"${PYTHON:-python3}" -m venv "$work/venv"
"$v/pip" install -q "torch==${TORCH_OLDEST:-2.4.0}" ninja wheel pytest hypothesis expecttest numpy 'setuptools<77'

step "--no-build-isolation with setuptools $("$v/python" -c 'import setuptools; print(setuptools.__version__)'): must say what to install"
if "$v/pip" install --no-build-isolation --no-deps -e . > "$work/old-setuptools.log" 2>&1; then
  fail "installed with a setuptools older than 77"
fi
grep -q "pip install 'setuptools>=77' wheel ninja" "$work/old-setuptools.log" \
  || { cat "$work/old-setuptools.log"; fail "no clear message about the setuptools version"; }

step "plain pip install . (build isolation), CPU kernels only, with the tests' C++ hooks"
DPFAST_CUDA=0 DPFAST_TEST_HOOKS=1 "$v/pip" install -q .
"$v/pip" install -q 'setuptools>=77'  # the packaging tests read setup.py, which refuses an older one

step "the suite, from outside the tree, on torch $("$v/python" -c 'import torch; print(torch.__version__)')"
cd "$work/elsewhere"
DPFAST_REQUIRE_EXTENSION=1 "$v/python" -m dpfast info
DPFAST_REQUIRE_EXTENSION=1 "$v/python" -m pytest -q -p no:cacheprovider "$repo/tests"
rm -rf "$work/venv"  # a full torch install (GBs), of no use once the suite has passed
step "passed"
