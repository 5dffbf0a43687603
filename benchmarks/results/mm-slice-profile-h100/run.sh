#!/usr/bin/env bash
# slice-1gpu-mm cut to 4 experts top-2 so that it fits one H100 80GB: its plan, a torch profile of 2 steps after 4
# warm-up steps (benchmarks/scripts/profile_step.py --shapes), then `muse-stack run` (the recipe's 20 steps), on
# receipt images drawn by `data/make_tiny_receipts.py --scale 6`. Needs TE 2.20.2 + megatron-core 0.19.2 in
# /tmp/site (benchmarks/scripts/stage-gpu.sh te-install).
#   usage: OUT=dir bash benchmarks/results/mm-slice-profile-h100/run.sh [profile] [run]
# Writes $OUT/mm-slice-profile-h100/: profile.json and profile.log (profile; the plan is printed before it); run/ with the run's
# results.json, metrics.jsonl, fingerprint.json, recipe.yaml and run.log, and nvidia-smi.csv (run). As run, the two
# steps were two calls on the same machine, the profile first; `muse-stack` is the CLI below.
set -uo pipefail
export PYTHONPATH=/tmp/site:benchmarks:. PYTHONUNBUFFERED=1
SHAPE="model.overrides.num_local_experts=4 model.overrides.num_experts_per_tok=2 hardware.gpu=H100"
OUT=${OUT:-bench-out}/mm-slice-profile-h100
mkdir -p "$OUT/run" runs
[ $# -eq 0 ] && set -- profile run
python3 data/make_tiny_receipts.py --scale 6
for what in "$@"; do
  case "$what" in
  profile)
    echo "=== profile $(date +%T)"
    python3 -m muse_stack.cli plan slice-1gpu-mm $SHAPE
    # as it ran: with the allocator's expandable segments (the run below ran without them)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/scripts/profile_step.py slice-1gpu-mm $SHAPE \
      --steps 2 --warmup 4 --shapes --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log"
    echo "rc=${PIPESTATUS[0]}" ;;
  run)
    echo "=== run $(date +%T)"
    rm -rf runs/mm1
    python3 -m muse_stack.cli run slice-1gpu-mm $SHAPE --no-progress --out runs/mm1 2>&1 | tee "$OUT/run/run.log"
    echo "rc=${PIPESTATUS[0]}"
    cp runs/mm1/results.json runs/mm1/metrics.jsonl runs/mm1/fingerprint.json runs/mm1/recipe.yaml "$OUT/run/"
    nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv \
      > "$OUT/nvidia-smi.csv" ;;
  *) echo "unknown step $what (profile, run)" >&2; exit 2 ;;
  esac
done
