#!/usr/bin/env bash
# CPU only: the planner's estimates with the calibrated defaults of muse_stack/plan/memory.py.
# plan-*.before-calibration.json were written on the H200 machine with the earlier defaults
# (runtime_overhead_gib 3.0, allocator_slack 0.10).
set -euo pipefail
for r in proxy-1gpu proxy-2gpu slice-1gpu; do muse-stack plan $r --json > plan-$r.json; done
muse-stack plan slice-1gpu batch.mbs=2 --json > plan-slice-1gpu-mbs2.json
muse-stack plan proxy-2gpu layout.ep=1 layout.tp=2 recompute.granularity=full --json > plan-tp2-recompute.json
