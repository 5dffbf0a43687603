# Image targets, included by the top-level Makefile.
#   make image gpu=gb200|b200|h200|cpu      build the image of a lock (docker buildx; ENGINE=podman)
#   make image-test gpu=cpu                 build the cpu image with podman and run it (CI proof)
#   make image-args gpu=...                 print the build arguments the lock yields
#   make image-check                        validate every lock, every pin resolved (--strict)
#   make pins gpu=...                       (networked) read and pin the base digest and EFA checksum
# Variables: PY (python with muse_stack), ENGINE (docker|podman), CA_BUNDLE (extra CA as build
# secret `ca`), PUSH=1 (docker buildx --push), FIND_LINKS (local wheel dir, podman).
PY ?= .venv/bin/python
ENGINE ?= docker
gpu ?= cpu
IMAGE_LOCKS := $(filter-out pylock.%,$(basename $(notdir $(wildcard containers/locks/*.toml))))

.PHONY: image image-test image-args image-check image-test-pytest

image: setup
	@test -f containers/locks/$(gpu).toml || { echo "gpu=$(gpu): no containers/locks/$(gpu).toml (have: $(IMAGE_LOCKS))"; exit 2; }
	@if [ "$(gpu)" = cpu ]; then \
	  base=$$(ENGINE=$(ENGINE) PY=$(PY) containers/make-base.sh cpu) || exit 1; \
	  ENGINE=$(ENGINE) PY=$(PY) CA_BUNDLE=$(CA_BUNDLE) FIND_LINKS=$(FIND_LINKS) BASE_DIGEST=$$base \
	    containers/build-image.sh cpu; \
	else \
	  ENGINE=$(ENGINE) PY=$(PY) CA_BUNDLE=$(CA_BUNDLE) FIND_LINKS=$(FIND_LINKS) PUSH=$(PUSH) MAX_JOBS=$(MAX_JOBS) containers/build-image.sh $(gpu); \
	fi

image-test:
	@test "$(gpu)" = cpu || { echo "image-test builds and runs the cpu image only (gpu=cpu)"; exit 2; }
	@PY=$(PY) containers/image-test.sh $(gpu); rc=$$?; \
	  if [ $$rc -eq 77 ]; then echo "image-test skipped: the container tools cannot run here (reason above)"; exit 0; fi; \
	  exit $$rc

image-test-pytest:
	$(PY) -m pytest -m image tests/system/test_image_build.py -q

image-args:
	@$(PY) -m muse_stack.cli stack build-args $(gpu)

image-check:
	@for l in $(IMAGE_LOCKS); do $(PY) -m muse_stack.cli stack check --strict $$l || exit 1; done

# On a networked builder: read the lock's base index digest and EFA installer sha256 from their
# sources, compare them with the lock, and write the ones it leaves null (muse-stack stack pins)
.PHONY: pins
pins: setup
	@test -f containers/locks/$(gpu).toml || { echo "gpu=$(gpu): no containers/locks/$(gpu).toml (have: $(IMAGE_LOCKS))"; exit 2; }
	$(PY) -m muse_stack.cli stack pins $(gpu) --write
