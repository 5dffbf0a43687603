#!/usr/bin/env bash
# Bitwise resume with adapter dropout on one GPU (issue 32): benchmarks/scripts/h200.sh's resumedrop step.
# proxy-1gpu with 8 experts (top 2), dense LoRA (rank 8, alpha 16, dropout 0.1 on q/v/o), deterministic kernels,
# 6 steps uninterrupted (resumedrop-full) and interrupted after step 3 then resumed (resumedrop-part), compared
# bit for bit (resumedrop-bitwise.json, and `muse-stack compare` in resumedrop-compare.json); then
# tests/gpu/test_resume_gpu.py runs the same check under pytest. Needs TE 2.20.2 + megatron-core 0.19.2 in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). Writes into $OUT/resumedrop.
set -uo pipefail
export PYTHONPATH=/tmp/site
OUT=${OUT:-bench-out}/resumedrop STEP_TIMEOUT=400 bash benchmarks/scripts/h200.sh resumedrop
