#!/usr/bin/env bash
# slice-1gpu as shipped (training.gc: manual collection, every 100 steps, so none inside the 30-step run) several
# times back to back in one sitting on one H200, and with Python's automatic collector
# (training.gc.manual=false) for contrast. Each run's results.json, metrics.jsonl, fingerprint.json and
# recipe.yaml are kept under $OUT/gc-steady/NAME. Needs TE 2.20.2 + megatron-core 0.19.2 importable
# (benchmarks/scripts/stage-gpu.sh te-install stages them into /tmp/site); the environment is benchmarks/scripts/h200.sh's.
#   usage: OUT=dir bash benchmarks/results/gc-steady/run.sh [NAME...]   (default: manual1 manual2 manual3 auto1)
#   NAME: manualN (as shipped) or autoN (training.gc.manual=false), 30 steps (the recipe's, window 11-30);
#         manual-100 / auto-100: the same at --steps 100 (window 11-100; the hand collection falls after step 100)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}
mkdir -p "$OUT/gc-steady" runs
[ $# -eq 0 ] && set -- manual1 manual2 manual3 auto1
for name in "$@"; do
  case "$name" in
  manual*) over=() ;;                             # the recipe as shipped
  auto*) over=(training.gc.manual=false) ;;       # the automatic collector, as before training.gc
  *) echo "unknown run $name (manualN, autoN, manual-100 or auto-100)" >&2; exit 2 ;;
  esac
  case "$name" in *-100) over+=(--steps 100) ;; esac
  echo "=== $name $(date +%T)"
  rm -rf "runs/gc-$name"
  CUDA_VISIBLE_DEVICES=0 timeout "${STEP_TIMEOUT:-600}" \
    python3 -m muse_stack.cli run slice-1gpu "${over[@]}" --no-progress --out "runs/gc-$name"
  echo "rc=$?"
  mkdir -p "$OUT/gc-steady/$name"
  cp "runs/gc-$name"/results.json "runs/gc-$name"/metrics.jsonl "runs/gc-$name"/fingerprint.json \
    "runs/gc-$name"/recipe.yaml "$OUT/gc-steady/$name/" 2>/dev/null
done
