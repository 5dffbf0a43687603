#!/usr/bin/env bash
# The experts' token counts read before the latent GEMM and the pre-MLP norm in the post-attention residual's chain,
# attributed on slice-1gpu in one device call. TE 2.20.2 + megatron-core 0.19.2 staged into /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). Device, from the project root:
#   STEP_TIMEOUT=150 OUT=out bash benchmarks/results/early-expert-counts-and-pre-mlp-norm/run.sh
# -> out/early-expert-counts-and-pre-mlp-norm.tgz: early-expert-counts-and-pre-mlp-norm/{fingerprint,shipped,before,late-counts,separate-pre-mlp-norm,shipped-again,
#    profile-shipped}.json, gpu-test.txt
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
exec bash "$(dirname "$0")/../../scripts/h200.sh" levers7
