#!/usr/bin/env bash
# The experts' SwiGLU backward by TE's dswiglu and the step's first micro-batch writing the main gradients, attributed
# on slice-1gpu, in two device calls on one lease. TE 2.20.2 + megatron-core 0.19.2 staged into /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). Device, from the project root:
#   STEP_TIMEOUT=200 OUT=out bash benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/run.sh levers8gpu
#     -> out/te-swiglu-backward-and-first-microbatch-writes/{gpu-test.txt,kernels.json}
#   STEP_TIMEOUT=150 OUT=out bash benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/run.sh levers8
#     -> out/te-swiglu-backward-and-first-microbatch-writes.tgz: te-swiglu-backward-and-first-microbatch-writes/{fingerprint,shipped,before,mcore-swiglu,whole-buffer,shipped-again,
#        candidate-multi-kernel,profile-shipped}.json
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
exec bash "$(dirname "$0")/../../scripts/h200.sh" "${1:?levers8gpu or levers8}"
