#!/usr/bin/env bash
# The multimodal slice on one H200: first the megatron engine's towers against the reference
# model (`python -m lab.verify.parity --towers`: toy towers and decoder, an image and an
# audio clip in the row, forward and 3 training steps), then `muse-stack run slice-1gpu-mm` (the
# released towers + two decoder layers at real width on receipt images drawn by
# `data/make_tiny_receipts.py --scale 6`). Needs TE 2.20.2 + megatron-core 0.19.2 in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install).   usage: OUT=dir bash benchmarks/results/mm-slice/run.sh [parity] [slice]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.:benchmarks
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}/mm-slice
mkdir -p "$OUT" runs
[ $# -eq 0 ] && set -- parity slice
for what in "$@"; do
  case "$what" in
  parity)
    echo "=== parity $(date +%T)"
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m lab.verify.parity --towers --train-steps 3 \
      --out "$OUT/parity-towers.json" 2>&1 | tail -5
    echo "rc=${PIPESTATUS[0]}" ;;
  slice)
    echo "=== slice $(date +%T)"
    python3 data/make_tiny_receipts.py --scale 6
    rm -rf runs/mm-slice
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m muse_stack.cli run slice-1gpu-mm --no-progress --out runs/mm-slice \
      2>&1 | tail -30
    echo "rc=${PIPESTATUS[0]}"
    cp runs/mm-slice/results.json runs/mm-slice/metrics.jsonl runs/mm-slice/fingerprint.json runs/mm-slice/recipe.yaml \
      "$OUT/" 2>/dev/null
    python3 -m muse_stack.cli plan slice-1gpu-mm > "$OUT/plan.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/nvidia-smi.csv" ;;
  *) echo "unknown step $what (parity, slice)" >&2; exit 2 ;;
  esac
done
