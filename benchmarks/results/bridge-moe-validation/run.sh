#!/usr/bin/env bash
# CPU only, from the project root. The published runs, the models' shapes, each run's settings and the protocol are
# muse_stack/plan/published/bridge-moe.yaml. First the fit on the protocol's fit rows only (the DGX-GB300 runs):
# the Blackwell kernel efficiency and the host time of a MoE layer's forward, written into
# muse_stack/plan/calibration.json (scale); fit.json is its output. Then every row predicted with that
# calibration, each validation row's layout ranked among those tune finds, and the B200 record's two layouts split
# into named terms; validation.json is its output.
set -euo pipefail
python benchmarks/scripts/plan/validate_bridge.py --fit --write --json benchmarks/results/bridge-moe-validation/fit.json
python benchmarks/scripts/plan/validate_bridge.py --json benchmarks/results/bridge-moe-validation/validation.json
