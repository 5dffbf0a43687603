#!/usr/bin/env bash
# CPU only, from the project root. The result before the protocol's third amendment: every row of
# muse_stack/plan/published/bridge-moe.yaml priced as it ran, every run's host time the fitted forward figure
# (scale.moe_sync_gap_s), graphed or not. The code and data that made it are the tree before the commit that added
# this folder; this remakes both files from an export of that tree, leaving this tree's calibration as it is.
exec bash benchmarks/scripts/plan/rebuild_archive.sh benchmarks/results/archive/bridge-moe-validation-forward-host-gap
