#!/usr/bin/env bash
# CPU only, from the project root: fit the planner's memory calibration (muse_stack/plan/memory.py,
# Calibration) to the peak allocated memory of every uncompiled GPU run in benchmarks/, and print
# each run's estimate with the fitted and the current defaults. fit.json is its output; --write writes
# the fit into muse_stack/plan/calibration.json (as fit_used.py --write writes its measurement).
# Then fit the step-time model's efficiencies (muse_stack/plan/cost.py, TimeCalibration) to the
# runs' step times; fit_time.json is its output. Its host times and eager passes reach the planner's
# calibration (muse_stack/plan/calibration.json) through the sweep's refit, which holds them
# (bash benchmarks/results/plan-sweep/run.sh, after this). fit_used.json: the allocator reserve and the memory
# outside the allocator, measured on the runs that recorded device memory. Then the B200 record check and tune.
set -euo pipefail
python benchmarks/scripts/plan/fit.py --json benchmarks/results/plan/fit.json --write
python benchmarks/scripts/plan/fit_time.py --json benchmarks/results/plan/fit_time.json
python benchmarks/scripts/plan/fit_used.py --json benchmarks/results/plan/fit_used.json --write
python benchmarks/scripts/plan/validate.py --json benchmarks/results/plan/validate.json
