#!/usr/bin/env bash
# CPU only, from the project root. The first result: every row of muse_stack/plan/published/bridge-moe.yaml priced
# with the page's printed columns (the file before its run_settings), the two constants fitted to the GB300 rows
# as printed. The code and data that made it are the tree before the commit that added this folder; this remakes
# both files from an export of that tree, leaving this tree's calibration as it is.
exec bash benchmarks/scripts/plan/rebuild_archive.sh benchmarks/results/archive/bridge-moe-validation-printed-layouts
