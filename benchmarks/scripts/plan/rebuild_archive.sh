#!/usr/bin/env bash
# CPU only, from the project root: remake an archived result of the planner's step time at scale
# (benchmarks/results/archive/NAME: fit.json and validation.json) with the code and data that made it, the tree
# before the commit that added the folder, exported to a temporary directory; this tree's calibration stays as it is.
#   usage: bash benchmarks/scripts/plan/rebuild_archive.sh benchmarks/results/archive/NAME
set -euo pipefail
folder=${1:?usage: rebuild_archive.sh benchmarks/results/archive/NAME}
here=$PWD/$folder
added=$(git log --format=%H --diff-filter=A -1 -- "$folder/result.json")
[ -n "$added" ] || { echo "rebuild_archive.sh: no commit adds $folder/result.json: commit the folder first" >&2; exit 1; }
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git archive "$added^" | tar -x -C "$tree"
cd "$tree"
PYTHONPATH=$tree python benchmarks/scripts/plan/validate_bridge.py --fit --json "$here/fit.json"
PYTHONPATH=$tree python benchmarks/scripts/plan/validate_bridge.py --json "$here/validation.json"
