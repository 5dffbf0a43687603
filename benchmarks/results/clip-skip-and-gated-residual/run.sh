#!/usr/bin/env bash
# The clip scale that skips unclipped steps and the gated residual compiled on its direct calls, attributed on
# slice-1gpu in one device call. TE 2.20.2 + megatron-core 0.19.2 staged into /tmp/site (benchmarks/scripts/stage-gpu.sh te-install).
# Here:   git archive 978a570 muse_stack benchmarks/scripts recipes data | gzip > .whl/before.tgz   (the tree before)
# Device (carry .whl/before.tgz), from the project root:
#   mkdir -p /tmp/before && tar xzf .whl/before.tgz -C /tmp/before
#   BEFORE=/tmp/before STEP_TIMEOUT=150 OUT=out bash benchmarks/results/clip-skip-and-gated-residual/run.sh
# -> out/clip-skip-and-gated-residual/{fingerprint,shipped,te-clip-scale,shipped-again,before,profile-shipped,clip-scale}.json, gpu-test.txt
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
exec bash "$(dirname "$0")/../../scripts/h200.sh" levers6
