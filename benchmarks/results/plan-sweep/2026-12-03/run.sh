#!/usr/bin/env bash
# The planner's step-time sweep of 3 Dec 2026, 15:35 UTC (9 of the 11 runs): slice-1gpu as shipped and each
# neighbour of its settings, engine_steps.py runs on one H200 in one call, then the fit on a CPU. See README.md here.
#   device: the committed runs came from `STEP_TIMEOUT=120 OUT=... timeout 540 bash benchmarks/scripts/h200.sh
#     plansweep` (the device call's limit): the call ended before the last two runs and the fingerprint (README.md).
#     plansweep now runs all eleven, over two calls (../run.sh).
#   here (CPU): bash benchmarks/results/plan-sweep/2026-12-03/run.sh       (the fit: fit.json)
set -euo pipefail
SWEEP=benchmarks/results/plan-sweep/2026-12-03 exec bash benchmarks/results/plan-sweep/run.sh "${1:-fit}"
