# muse-stack: `make demo` and `make test` set themselves up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# PyTorch for the CPU reference engine; pip takes a local CPU wheel when one is on its find-links
TORCH_SPEC ?= torch==2.13.0
# The tests by kind: tests/unit, tests/system, tests/lab, tests/gpu (README: Tests). make test runs
# unit, system and lab with the cpu image test among them, in two workers: a module is one unit of
# work (its fixtures set up once) and the longest go out first (tests/conftest.py). Not run: gpu
# (make test-gpu, on a GPU machine) and registry: what the locks' loose requirements resolve to
# today, a report for review (make locks-check)
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -rs
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
PYTEST_ARGS ?= -m "not gpu and not registry"

.PHONY: help setup demo test test-unit test-system test-lab test-gpu build-check clean
help:
	@echo "make demo   # set up, then run the tiny-cpu recipe end to end on this CPU"
	@echo "make test   # set up, then run the unit, system and lab tests and the cpu image test (two workers)"
	@echo "make test-unit | test-system | test-lab   # one kind (tests/<kind>/); test-system without the image build"
	@echo "make test-gpu   # the tests that need CUDA (on a GPU machine; they skip without it)"
	@echo "make locks-check   # drift report: would the locks resolve to their committed sets against the registry today?"
	@echo "make build-check   # only the build checks: a flash-attn kernel and a TE torch-extension unit compiled against the b200 lock's torch"
	@echo "make image gpu=gb200|b200|h200|cpu   # build a pinned image (see docs/images.md)"

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/muse-stack run tiny-cpu --out runs/demo-$$(date +%Y%m%d-%H%M%S)
	@echo; echo "Outputs: the run directory printed above (recipe.yaml, fingerprint.json, metrics.jsonl, results.json, loss.png, throughput.png, run.log, checkpoints/, tensorboard/). View it: .venv/bin/tensorboard --logdir runs"

test: setup
	MUSE_STACK_IMAGE_TEST=1 $(PYTEST) $(XDIST) $(PYTEST_ARGS) tests/unit tests/system tests/lab

test-unit test-system test-lab: test-%: setup
	$(PYTEST) $(XDIST) -m "not gpu and not registry and not image" tests/$*

test-gpu: setup
	$(PYTEST) -m gpu tests

# flash-attn and TE's torch extension compiled here against the lock's torch, with the registry's
# nvcc (tests/system/test_build_kernels.py, marker build; part of make test too)
build-check: setup
	$(PY) -m pytest -q -m build --durations=0 tests/system/test_build_kernels.py

clean:
	rm -rf $(VENV) runs .pytest_cache

include containers/image.mk

# drift for review, never a verdict on the code: would each lock's requirements resolve to its
# committed set against the registry as it lists packages today? (make test checks what the committed
# sets promise instead: tests/system/test_stack_wheelset.py)
.PHONY: locks-check
locks-check: setup
	$(VENV)/bin/muse-stack stack resolve --check
	$(PY) -m pytest -q -m registry

# the hash-pinned wheel set of every lock (containers/locks/pylock.<target>.toml), resolved with uv
.PHONY: wheelsets
wheelsets: setup
	$(VENV)/bin/muse-stack stack resolve
