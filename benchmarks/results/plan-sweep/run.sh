#!/usr/bin/env bash
# The planner's step-time refit (issue 34): slice-1gpu as shipped and each neighbour of its settings,
# engine_steps.py runs on one H200 in one call, then the fit on a CPU. See README.md here.
#
#   device (1 x H200, no registry), from the project root, with TE 2.20.2 + megatron-core 0.19.2 staged
#   into /tmp/site (shared/device/te-stage.sh):
#       OUT=dir bash benchmarks/results/plan-sweep/run.sh device
#     writes dir/plan-sweep/runs/NAME.json (runs/ here) and dir/plan-sweep/fingerprint.json.
#     The committed runs came from `STEP_TIMEOUT=120 OUT=... timeout 540 bash benchmarks/scripts/h200.sh plansweep`
#     (the device call's limit): the call ended before the last two runs and the fingerprint (README.md).
#   here (CPU): bash benchmarks/results/plan-sweep/run.sh       (the fit: fit.json)
# 2026-12-02/ holds the earlier sweep on the b200 wheel set, with its own run.sh.
set -euo pipefail
case "${1:-fit}" in
device)
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  STEP_TIMEOUT=${STEP_TIMEOUT:-120} OUT=${OUT:?OUT=dir} bash benchmarks/scripts/h200.sh plansweep ;;
fit)
  python benchmarks/scripts/plan/fit_time.py --sweep benchmarks/results/plan-sweep/runs \
    --json benchmarks/results/plan-sweep/fit.json ;;
*) echo "usage: run.sh [device|fit]" >&2; exit 2 ;;
esac
