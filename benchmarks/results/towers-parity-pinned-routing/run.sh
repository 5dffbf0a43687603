#!/usr/bin/env bash
# The towers' parity on one GPU (tests/lab/test_benchmarks_megatron.py's towers test, as lab.verify.parity runs it):
# routing pinned by the expert-bias ladder, the same with a damaged vision projection (the negative control), and
# unpinned as the test ran before. Needs TE 2.20.2 + megatron-core 0.19.2 in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install).
#   usage: OUT=dir bash benchmarks/results/towers-parity-pinned-routing/run.sh
set -euo pipefail
OUT=${OUT:-bench-out}/towers-parity-pinned-routing
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:benchmarks:.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv"
python3 -m lab.verify.parity --towers --pin-routing --train-steps 3 --out "$OUT/parity-towers-pinned.json"
python3 -m lab.verify.parity --towers --pin-routing --defect vision-projection-x1.5 --out "$OUT/parity-towers-defect.json"
python3 -m lab.verify.parity --towers --train-steps 3 --out "$OUT/parity-towers-unpinned.json"
