#!/usr/bin/env bash
# The word embedding's gradient added into main_grad (muse_stack/engines/mcore/embedding_grad.py) and, with it, the
# post-expert norm's one-pass backward (norm_backward.py), measured on slice-1gpu: the GPU tests, then the step with
# the embedding's change / with megatron-core's dense lookup / with the change again (each with the norm backward as
# the compiled chain's), then with both, and the verdict, which sets the norm backward's switch in layers.py. One
# device call; TE 2.20.2 + megatron-core 0.19.2 staged into /tmp/site (benchmarks/scripts/stage-gpu.sh te-install). Device, from the
# project root:
#   OUT=out bash benchmarks/results/embedgrad/run.sh
#     -> out/embedgrad.tgz: embedgrad/{fingerprint,with,without,with-again,both,verdict}.json, gpu-test.txt,
#        verdict.txt
# (the runs committed here ran before the norm backward shipped on, so with/without/with-again ran it off as
# shipped then, and both.json with --fused-norm-backward: the same four configurations this script runs)
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
exec bash "$(dirname "$0")/../../scripts/h200.sh" embedgrad
