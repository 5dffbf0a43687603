#!/usr/bin/env bash
# FP8 (TE current scaling: fp8.recipe=tensorwise, fp8.format=hybrid) on slice-1gpu's shipped allgather dispatcher,
# against bf16 on the same dispatcher and both precisions on the alltoall dispatcher, each its own process, in one
# lease of one machine; then a long FP8 run against bf16 on the shipped dispatcher, judged by `compare` (its default
# preset, Bridge's convergence check). Needs TE 2.20.2 + megatron-core 0.19.2 in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install).
#   usage: OUT=dir bash benchmarks/scripts/fp8_dispatch.sh verify   (lab.verify.fp8_experts: the engine's padded expert
#            path against megatron-core's expert forward, tiny model, deterministic; tests/gpu/test_fp8_experts_gpu.py)
#          OUT=dir [SHAPE_OVERRIDES="a.b=c ..."] bash benchmarks/scripts/fp8_dispatch.sh speed|shipped
#          OUT=dir [SHAPE_OVERRIDES=...] [STEPS=300] [PART=fp8|bf16|compare] bash benchmarks/scripts/fp8_dispatch.sh converge
# SHAPE_OVERRIDES: a smaller slice for an 80 GB card (each run's recipe.yaml records it).
# On the allgather dispatcher megatron-core refuses its routing-map padding, so the experts pad their own rows
# (TEGroupedMLP's TE Fp8Padding; muse_stack/engines/mcore/config.py fp8_kwargs).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}/fp8-dispatch
FP8="precision=fp8 fp8.recipe=tensorwise fp8.format=hybrid"
mkdir -p "$OUT" runs
one() {  # name, extra overrides...
  local name=$1; shift
  echo "=== $name $(date +%T)"
  rm -rf "runs/fp8d-$name"
  PYTHONPATH=/tmp/site:${PYTHONPATH:-}:. CUDA_VISIBLE_DEVICES=0 timeout 590 \
    python3 -m muse_stack.cli run slice-1gpu ${SHAPE_OVERRIDES:-} "$@" --no-progress --out "runs/fp8d-$name" \
    > "runs/fp8d-$name.log" 2>&1
  echo "rc=$?"; tail -2 "runs/fp8d-$name.log"
  mkdir -p "$OUT/$name"
  cp "runs/fp8d-$name.log" "$OUT/$name/run-output.log"
  cp "runs/fp8d-$name"/{results.json,metrics.jsonl,fingerprint.json,recipe.yaml} "$OUT/$name/" 2>/dev/null
}
case "${1:-speed}" in
verify)
  PYTHONPATH=/tmp/site:benchmarks:. python3 -m lab.verify.fp8_experts --steps 2 --out "$OUT/fp8-experts.json" \
    > "$OUT/fp8-experts.log" 2>&1; echo "fp8_experts rc=$?"; tail -3 "$OUT/fp8-experts.log" ;;
shipped)  # the two runs on the shipped dispatcher only
  one bf16-allgather
  one fp8-allgather $FP8
  PYTHONPATH=/tmp/site:. python3 -m muse_stack.cli compare runs/fp8d-bf16-allgather runs/fp8d-fp8-allgather --json --no-plot \
    > "$OUT/compare-bf16-allgather-fp8-allgather.json" 2> "$OUT/compare-bf16-allgather-fp8-allgather.err"
  echo "compare rc=$?" ;;
speed)
  one bf16-allgather
  one fp8-allgather $FP8
  one bf16-alltoall layout.dispatcher=alltoall
  one fp8-alltoall $FP8 layout.dispatcher=alltoall
  for pair in "bf16-allgather fp8-allgather" "bf16-alltoall fp8-alltoall" "bf16-allgather bf16-alltoall"; do
    set -- $pair
    PYTHONPATH=/tmp/site:. python3 -m muse_stack.cli compare "runs/fp8d-$1" "runs/fp8d-$2" --json --no-plot \
      > "$OUT/compare-$1-$2.json" 2> "$OUT/compare-$1-$2.err"; echo "compare $1 $2 rc=$?"
  done ;;
converge)  # PART=fp8|bf16|compare runs one part per call, where both runs would not fit one call's 10 minutes
  S=${STEPS:-300}  # (the runs wait in runs/ on the warm machine); unset, all three in one call
  case "${PART:-all}" in fp8|all) one fp8-allgather-$S $FP8 training.steps=$S ;; esac
  case "${PART:-all}" in bf16|all) one bf16-allgather-$S training.steps=$S ;; esac
  case "${PART:-all}" in compare|all)
    PYTHONPATH=/tmp/site:. python3 -m muse_stack.cli compare "runs/fp8d-bf16-allgather-$S" "runs/fp8d-fp8-allgather-$S" --json --no-plot \
      > "$OUT/compare-$S-steps.json" 2> "$OUT/compare-$S-steps.err"; echo "compare rc=$?" ;;
  esac ;;
esac
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/nvidia-smi.csv"
