# muse-stack: `make demo` and `make test` set themselves up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# PyTorch for the CPU reference engine; pip takes a local CPU wheel when one is on its find-links
TORCH_SPEC ?= torch==2.13.0
# registry: what the locks' loose requirements resolve to today, a report for review (make locks-check)
PYTEST_ARGS ?= -m "not image and not registry"

.PHONY: help setup demo test unit build-check clean
help:
	@echo "make demo   # set up, then run the tiny-cpu recipe end to end on this CPU"
	@echo "make test   # set up, then run the test suite and the cpu image test"
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

unit: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: unit image-test

# flash-attn and TE's torch extension compiled here against the lock's torch, with the registry's
# nvcc (tests/test_build_kernels.py, marker build; part of make test too)
build-check: setup
	$(PY) -m pytest -q -m build --durations=0 tests/test_build_kernels.py

clean:
	rm -rf $(VENV) runs .pytest_cache

include containers/image.mk

# drift for review, never a verdict on the code: would each lock's requirements resolve to its
# committed set against the registry as it lists packages today? (make test checks what the committed
# sets promise instead: tests/test_stack_wheelset.py)
.PHONY: locks-check
locks-check: setup
	$(VENV)/bin/muse-stack stack resolve --check
	$(PY) -m pytest -q -m registry

# the hash-pinned wheel set of every lock (containers/locks/pylock.<target>.toml), resolved with uv
.PHONY: wheelsets
wheelsets: setup
	$(VENV)/bin/muse-stack stack resolve
