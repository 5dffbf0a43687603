#!/usr/bin/env bash
# Issue 34's engine levers on slice-1gpu, each alone against the shipped recipe, in one device call:
# TE 2.20.2 + megatron-core 0.19.2 staged into /tmp/site (benchmarks/scripts/stage-gpu.sh te-install), then from the project root
#   STEP_TIMEOUT=150 OUT=out bash benchmarks/results/engine-options-each-alone/run.sh
# -> out/engine-options-each-alone/{shipped,NAME...,shipped-again}.json, fingerprint.json, choice.txt (benchmarks/scripts/levers_choose.py)
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
exec bash "$(dirname "$0")/../../scripts/h200.sh" levers5
