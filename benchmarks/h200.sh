#!/usr/bin/env bash
# Every GPU measurement of the megatron-core engine in one call on a 2 x H200 machine.
# Needs TE 2.20.2 + megatron-core 0.19.2 importable (staged by shared/device/te-stage.sh into
# /tmp/site). Writes everything under ${OUT:-bench-out}; each step is listed in benchmarks/README.md.
#   usage: bash benchmarks/h200.sh STEP...   (default: smoke)
#   all of benchmarks/: fingerprint parity proxy1 slice slice2 slicec overhead proxy2 parity2 pp2 plan
#   ($OUT holds at most 8 files per device call: split the steps over calls, or tar $OUT)
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
  parity) one python3 -m muse_stack.engines.mcore.parity --train-steps 3 --out "$OUT/parity-tp1.json" ;;
  parity2)
    two -m muse_stack.engines.mcore.parity --tp 2 --out "$OUT/parity-tp2.json"
    two -m muse_stack.engines.mcore.parity --ep 2 --out "$OUT/parity-ep2.json" ;;
  smoke)
    rm -rf runs/smoke-proxy1 runs/smoke-slice; one $MS run proxy-1gpu --steps 3 --out runs/smoke-proxy1 --no-progress && tail -3 runs/smoke-proxy1/metrics.jsonl
    one $MS run slice-1gpu --steps 2 --out runs/smoke-slice --no-progress && tail -2 runs/smoke-slice/metrics.jsonl ;;
  proxy1) rm -rf runs/proxy-1gpu; one $MS run proxy-1gpu --out runs/proxy-1gpu --no-progress; keep proxy-1gpu runs/proxy-1gpu ;;
  slice) rm -rf runs/slice-1gpu; one $MS run slice-1gpu --out runs/slice-1gpu --no-progress; keep slice-1gpu runs/slice-1gpu ;;
  slice2) rm -rf runs/slice-1gpu-mbs2; one $MS run slice-1gpu batch.mbs=2 --out runs/slice-1gpu-mbs2 --no-progress
          keep slice-1gpu-mbs2 runs/slice-1gpu-mbs2 ;;
  slicec) rm -rf runs/slice-c; MUSE_STACK_MCORE_COMPILE=1 one $MS run slice-1gpu batch.mbs=2 --out runs/slice-c --no-progress
          keep slice-1gpu-mbs2-compiled runs/slice-c ;;
  overhead) one python3 benchmarks/overhead.py slice-1gpu --steps 8 --warmup 3 --out "$OUT/overhead-slice-mbs1.json"
            MUSE_STACK_MCORE_COMPILE=1 one python3 benchmarks/overhead.py slice-1gpu batch.mbs=2 --steps 8 --warmup 3 \
              --out "$OUT/overhead-slice-mbs2-compiled.json" ;;
  proxy2) rm -rf runs/proxy-2gpu; two -m muse_stack.cli run proxy-2gpu --out runs/proxy-2gpu --no-progress; keep proxy-2gpu runs/proxy-2gpu ;;
  pp2) # PP 2 with uneven stages (1 + 3 layers), then TP 2 with sequence parallelism and full recompute
    rm -rf runs/pp2 runs/tp2; two -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.pp=2 'layout.pp_layers=[1,3]' \
      --steps 6 --out runs/pp2 --no-progress; keep pp2 runs/pp2
    two -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.tp=2 recompute.granularity=full --steps 6 --out runs/tp2 \
      --no-progress; keep tp2 runs/tp2 ;;
  plan) for r in proxy-1gpu proxy-2gpu slice-1gpu; do $MS plan $r --json > "$OUT/plan-$r.json"; done ;;
  *) echo "unknown step $what" ;;
  esac
done
