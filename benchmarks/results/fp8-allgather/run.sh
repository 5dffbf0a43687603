#!/usr/bin/env bash
# FP8 (TE current scaling: fp8.recipe=tensorwise, fp8.format=hybrid) on slice-1gpu's shipped allgather dispatcher
# against bf16 on the same dispatcher, the slice cut to 8 experts top-2 so that it fits an 80 GB card, on one H100;
# and the engine's padded FP8 expert path against megatron-core's expert forward (lab.verify.fp8_experts). Needs
# TE 2.20.2 + megatron-core 0.19.2 in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install).
#   usage: OUT=dir bash benchmarks/results/fp8-allgather/run.sh
# Writes $OUT/fp8-dispatch/: fp8-experts.{json,log}, bf16-allgather/ and fp8-allgather/ (each run's results.json,
# metrics.jsonl, fingerprint.json, recipe.yaml, run-output.log), compare-bf16-allgather-fp8-allgather.{json,err} and
# nvidia-smi.csv. As run, the two commands below were two calls on the same machine, with OUT=o.
set -euo pipefail
export OUT=${OUT:-bench-out}
bash benchmarks/scripts/fp8_dispatch.sh verify
SHAPE_OVERRIDES="model.overrides.num_local_experts=8 model.overrides.num_experts_per_tok=2 hardware.gpu=H100" \
  bash benchmarks/scripts/fp8_dispatch.sh shipped
