#!/usr/bin/env bash
# The post-expert norm's one-pass backward (muse_stack/engines/mcore/norm_backward.py), measured on slice-1gpu:
# its GPU test, the norm's kernels alone with the one-pass backward's launch grid, the fastest launch written into the
# module, then the step with it / without it / with it again, and the verdict. One device call; TE 2.20.2 +
# megatron-core 0.19.2 staged into /tmp/site (benchmarks/scripts/stage-gpu.sh te-install). Device, from the project root:
#   STEP_TIMEOUT=150 OUT=out bash benchmarks/results/normbwd/run.sh
#     -> out/normbwd.tgz: normbwd/{fingerprint,kernels,with,without,with-again}.json, gpu-test.txt, launch.txt,
#        verdict.txt
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
exec bash "$(dirname "$0")/../../scripts/h200.sh" normbwd
