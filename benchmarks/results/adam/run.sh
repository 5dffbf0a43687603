#!/usr/bin/env bash
# Adam's update as one Triton launch per parameter group (muse_stack/engines/mcore/adam_step.py), measured on
# slice-1gpu: the GPU tests, TE's FusedAdam alone stepped by TE and by the Triton step over the launch grid, the fastest
# launch written into the module, then the step as shipped / with TE's step / as shipped again / with the one-pass
# norm backward too, and the verdict; then a profile of the shipped step. TE 2.20.2 + megatron-core 0.19.2 staged into
# /tmp/site (benchmarks/scripts/stage-gpu.sh te-install). Device, from the project root, two calls:
#   STEP_TIMEOUT=170 OUT=out bash benchmarks/results/adam/run.sh
#     -> out/adam.tgz: adam/{fingerprint,kernels,with,without,with-again,with-norm-backward}.json, gpu-test.txt,
#        launch.txt, verdict.txt
#   PROFILE=1 OUT=out bash benchmarks/results/adam/run.sh   -> out/profile-shipped.json
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.
if [ -n "${PROFILE:-}" ]; then
  exec python3 benchmarks/scripts/profile_step.py slice-1gpu --warmup 5 --steps 2 --shapes --out "$OUT/profile-shipped.json"
fi
exec bash "$(dirname "$0")/../../scripts/h200.sh" adam
