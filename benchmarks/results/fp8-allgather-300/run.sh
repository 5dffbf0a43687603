#!/usr/bin/env bash
# 300 steps of FP8 (TE current scaling: fp8.recipe=tensorwise, fp8.format=hybrid) against 300 of bf16 on slice-1gpu's
# shipped allgather dispatcher, on the same data, the slice cut to 8 experts top-2 so that it fits an 80 GB card, one
# H100, each run its own process, then `compare` (its default preset, Bridge's convergence check). Needs TE 2.20.2 +
# megatron-core 0.19.2 in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install).
#   usage: OUT=dir bash benchmarks/results/fp8-allgather-300/run.sh
# Writes $OUT/fp8-dispatch/: fp8-allgather-300/ and bf16-allgather-300/ (each run's results.json, metrics.jsonl,
# fingerprint.json, recipe.yaml, run-output.log), compare-300-steps.{json,err} and nvidia-smi.csv. As run, one call
# (about 6 minutes); where one call's limit is shorter, PART=fp8, PART=bf16 and PART=compare run it in three.
set -euo pipefail
export OUT=${OUT:-bench-out}
SHAPE_OVERRIDES="model.overrides.num_local_experts=8 model.overrides.num_experts_per_tok=2 hardware.gpu=H100" \
  STEPS=300 bash benchmarks/scripts/fp8_dispatch.sh converge
