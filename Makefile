# dpfast: `make demo` shows it working, `make test` checks everything. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CI builds the CUDA kernels for one architecture to keep compile time low (they cannot run without a GPU).
export TORCH_CUDA_ARCH_LIST ?= 9.0
export DPFAST_CUDA ?= auto
PYTEST_ARGS ?=

.PHONY: all venv build test lint sanitize demo bench info dist clean torch-ddp-suite

all: test

# The venv is (re)made when missing or when the dependency list changes.
$(VENV)/.deps: pyproject.toml Makefile
	@echo "[make venv] installing torch and the test tools into $(VENV): minutes the first time (a few GB)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -m pip install -q "torch>=2.4" ninja build pytest hypothesis expecttest numpy matplotlib ruff transformers accelerate torchvision mypy \
		opacus torchmetrics diffusers torch_geometric lightning pytorch-forecasting
	$(PY) -m pip install -q mkdocs mkdocs-material "mkdocstrings[python]"  # make docs (the site, offline)
	touch $@

venv: $(VENV)/.deps

# ninja keeps objects in build/, so only changed sources recompile. pip shows a build's output only with -v: the
# [dpfast build] lines (what is compiled and why) come to the terminal as they are written, everything goes to
# build/build.log, and the log's end is shown if the build fails.
build: SHELL := /bin/bash
build: .SHELLFLAGS := -o pipefail -c
build: venv
	@mkdir -p build
	@$(PY) -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee build/build.log | \
	  grep --line-buffered '\[dpfast build\]' || \
	  { tail -n 30 build/build.log; echo "[make build] failed; the whole log: build/build.log"; exit 1; }
	$(PY) -m dpfast info

# the tests' C++ hooks (dpfast._C_hooks, csrc/testing/) are built for the tests only
test: export DPFAST_TEST_HOOKS ?= 1
test: build lint typecheck docs
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy --strict over code that uses dpfast, as a user's type checker reads it: a typed user script and the examples.
.PHONY: typecheck
typecheck: venv
	$(PY) -m mypy --config-file tests/typed/mypy.ini tests/typed/user_code.py examples

# The docs site (mkdocs.yml, docs/) into site/, strict: a broken link or cross-reference, or a docstring section that
# does not match its signature, fails the build. Offline: no web fonts, no plugin that fetches.
.PHONY: docs
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The CPU extension under AddressSanitizer + UBSan (build/sanitize), the op tests and a seeded fuzzer against it.
FUZZ_SECONDS ?= 60
sanitize: venv
	PY=$(PY) FUZZ_SECONDS=$(FUZZ_SECONDS) bash tests/sanitize.sh

demo: build
	$(PY) -m dpfast demo

# torch's own DDP tests (installed with torch) against torch's DDP and dpfast's drop-in, on the CPU over 2 gloo
# ranks: every DDP test, to see which torch passes here (the suite's test runs the ones it does, tests/torch_ddp_suite.py)
torch-ddp-suite: build
	$(PY) tests/torch_ddp_suite.py --all

bench: build
	$(PY) -m dpfast bench

info: build

# dist/: the sdist, then the wheel built from the sdist alone, against .venv's torch (the wheel requires that torch
# release line). A wheel to hand out covers every architecture torch was built for, unless DIST_CUDA_ARCH_LIST says.
DIST_CUDA_ARCH_LIST ?=
dist: export TORCH_CUDA_ARCH_LIST = $(DIST_CUDA_ARCH_LIST)
dist: export DPFAST_TEST_HOOKS = 0
dist: venv
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf build dist site *.egg-info dpfast/_C*.so benchmarks/results .pytest_cache
