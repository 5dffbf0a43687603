#!/usr/bin/env bash
# Every GPU measurement of the megatron-core engine in one call on a 2 x H200 machine.
# Needs TE 2.20.2 + megatron-core 0.19.2 importable (staged by shared/device/te-stage.sh into
# /tmp/site). Writes everything under ${OUT:-bench-out}; each step is listed in benchmarks/README.md.
#   usage: bash benchmarks/h200.sh [smoke|parity|proxy1|slice|overhead|proxy2|parity2|fingerprint ...]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}
mkdir -p "$OUT" runs
MS="python3 -m muse_stack.cli"
one() { CUDA_VISIBLE_DEVICES=0 "$@"; }
two() { torchrun --standalone --nproc-per-node 2 "$@"; }
keep() { # keep a run directory's small files under $OUT/$1
  mkdir -p "$OUT/$1"; cp "$2"/results.json "$2"/metrics.jsonl "$2"/fingerprint.json "$OUT/$1/" 2>/dev/null; }
for what in "${@:-smoke}"; do
  echo "=== $what $(date +%T)"
  case "$what" in
  fingerprint) one $MS fingerprint -o "$OUT/fingerprint-h200.json" ;;
  parity) one python3 -m muse_stack.engines.mcore.parity --out "$OUT/parity-tp1.json" ;;
  parity2)
    two -m muse_stack.engines.mcore.parity --tp 2 --out "$OUT/parity-tp2.json"
    two -m muse_stack.engines.mcore.parity --ep 2 --out "$OUT/parity-ep2.json" ;;
  smoke)
    one $MS run proxy-1gpu --steps 3 --out runs/smoke-proxy1 --no-progress && tail -3 runs/smoke-proxy1/metrics.jsonl
    one $MS run slice-1gpu --steps 2 --out runs/smoke-slice --no-progress && tail -2 runs/smoke-slice/metrics.jsonl ;;
  proxy1) one $MS run proxy-1gpu --out runs/proxy-1gpu --no-progress; keep proxy-1gpu runs/proxy-1gpu ;;
  slice) one $MS run slice-1gpu --out runs/slice-1gpu --no-progress; keep slice-1gpu runs/slice-1gpu ;;
  slice2) one $MS run slice-1gpu batch.mbs=2 --out runs/slice-1gpu-mbs2 --no-progress
          keep slice-1gpu-mbs2 runs/slice-1gpu-mbs2 ;;
  overhead) one python3 benchmarks/overhead.py slice-1gpu --steps 8 --warmup 3 --out "$OUT/overhead.json" ;;
  proxy2) two -m muse_stack.cli run proxy-2gpu --out runs/proxy-2gpu --no-progress; keep proxy-2gpu runs/proxy-2gpu ;;
  plan) for r in proxy-1gpu proxy-2gpu slice-1gpu; do $MS plan $r --json > "$OUT/plan-$r.json"; done ;;
  *) echo "unknown step $what" ;;
  esac
done
