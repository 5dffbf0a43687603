#!/usr/bin/env bash
# The experts' GEMMs of one slice-1gpu micro-batch, isolated: TE's GroupedLinear against one cuBLAS matmul per
# expert and torch._grouped_mm (benchmarks/scripts/expert_gemm_bench.py), on one H200 with TE 2.20.2 staged into
# /tmp/site (benchmarks/scripts/stage-gpu.sh te-install). From the project root, in one device call:
#   OUT=out bash benchmarks/results/expert-gemm/run.sh
set -euo pipefail
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python3 benchmarks/scripts/expert_gemm_bench.py --out "$OUT/expert-gemm.json"
python3 -m muse_stack.cli fingerprint -o "$OUT/fingerprint.json"
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/nvidia-smi.csv"
