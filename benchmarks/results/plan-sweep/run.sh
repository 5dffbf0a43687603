#!/usr/bin/env bash
# The planner's step-time refit (issue 34): slice-1gpu as shipped and each neighbour of its settings,
# eleven engine_steps.py runs on one H200, then the fit on a CPU. See README.md here.
#
#   device (1 x H200, no registry), from the project root, with TE 2.20.2 + megatron-core 0.19.2 staged
#   into /tmp/site (benchmarks/scripts/stage-gpu.sh te-install), two calls on the same machine (each call has 10 minutes):
#       PART=1 OUT=dir bash benchmarks/results/plan-sweep/run.sh device
#       PART=2 OUT=dir bash benchmarks/results/plan-sweep/run.sh device
#     write dir/plan-sweep/runs/NAME.json (runs/ here) and dir/plan-sweep/fingerprint.json (here).
#     The committed runs came from `PART=1 STEP_TIMEOUT=120` and `PART=2 STEP_TIMEOUT=110` (README.md).
#   here (CPU): bash benchmarks/results/plan-sweep/run.sh       (the fit: fit.json, and the planner's
#     calibration written from it, muse_stack/plan/calibration.json; the plan against the side-by-side sittings,
#     each priced with the kernels it ran: sittings.json)
# 2026-12-03/ and 2026-12-02/ hold the earlier sweeps, each with its own run.sh (2026-12-03/'s is this one,
# with SWEEP=benchmarks/results/plan-sweep/2026-12-03).
set -euo pipefail
SWEEP=${SWEEP:-benchmarks/results/plan-sweep}
case "${1:-fit}" in
device)
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  STEP_TIMEOUT=${STEP_TIMEOUT:-120} OUT=${OUT:?OUT=dir} bash benchmarks/scripts/h200.sh plansweep ;;
fit)
  if [ "$SWEEP" = benchmarks/results/plan-sweep ]; then
    # the sweep the planner is calibrated by: its fit also written into muse_stack/plan/calibration.json
    python benchmarks/scripts/plan/fit_time.py --sweep "$SWEEP/runs" --json "$SWEEP/fit.json" --write
    # the plan against each side-by-side sitting, with the kernels each ran (sittings.json)
    python benchmarks/scripts/plan/sittings.py --json "$SWEEP/sittings.json"
  else
    python benchmarks/scripts/plan/fit_time.py --sweep "$SWEEP/runs" --json "$SWEEP/fit.json"
  fi ;;
*) echo "usage: run.sh [device|fit]" >&2; exit 2 ;;
esac
