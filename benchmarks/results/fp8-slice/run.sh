#!/usr/bin/env bash
# slice-1gpu with precision: fp8 (TE per-tensor current scaling, hybrid format) against the same recipe in bf16,
# in one call on one H200, and `compare` of the two. Needs TE 2.20.2 + megatron-core 0.19.2 importable
# (benchmarks/scripts/stage-gpu.sh te-install stages them into /tmp/site); the environment is benchmarks/scripts/h200.sh's.
#   usage: OUT=dir bash benchmarks/results/fp8-slice/run.sh [shipped|alltoall]   (default: shipped)
#   shipped: fp8 on the recipe as shipped (allgather dispatcher), then bf16 as shipped, then compare.
#   alltoall: fp8 and bf16 both with layout.dispatcher=alltoall (the shipped allgather dispatcher refuses
#     megatron-core's FP8 router padding), then compare each fp8 run against the bf16 runs; needs runs/bf16
#     from `shipped` on the same machine for the second compare.
#   BUDGET_S (default 420): the bf16 run starts only if at least BF16_NEED_S (default 150) seconds of it are left;
#   without it, the fp8 run is compared against the committed bf16 run benchmarks/results/gc-steady/manual1.
# Writes $OUT/{fp8.log,bf16.log,compare.json,compare-manual1.json,nvidia-smi.csv,runs.tgz}; runs.tgz holds
# each run's results.json, metrics.jsonl, fingerprint.json and recipe.yaml.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}:.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}
mode=${1:-shipped}
start=$(date +%s)
MS="python3 -m muse_stack.cli"
if [ "$mode" = alltoall ]; then
  # as run in the second call (inline there; the same commands): each run bounded so both fit in one call
  mkdir -p k
  timeout 130 $MS run slice-1gpu --no-progress --out runs/fp8a2a precision=fp8 fp8.recipe=tensorwise fp8.format=hybrid \
    layout.dispatcher=alltoall > "$OUT/fp8a2a.log" 2>&1
  echo rc=$? >> "$OUT/fp8a2a.log"; tail -3 "$OUT/fp8a2a.log"
  if [ $(( $(date +%s) - start )) -lt 105 ]; then
    timeout $((215 - ($(date +%s) - start))) $MS run slice-1gpu --no-progress --out runs/bf16a2a layout.dispatcher=alltoall \
      > "$OUT/bf16a2a.log" 2>&1
    echo rc=$? >> "$OUT/bf16a2a.log"; tail -2 "$OUT/bf16a2a.log"
  fi
  for r in fp8a2a bf16a2a; do
    mkdir -p "k/$r"; cp runs/$r/results.json runs/$r/metrics.jsonl runs/$r/fingerprint.json runs/$r/recipe.yaml "k/$r/" 2>/dev/null
  done
  tar czf "$OUT/runs2.tgz" k
  $MS compare runs/bf16 runs/fp8a2a --json --no-plot > "$OUT/cmp-bf16-fp8a2a.json" 2>&1
  [ -d runs/bf16a2a ] && $MS compare runs/bf16a2a runs/fp8a2a --json --no-plot > "$OUT/cmp-a2a.json" 2>&1
  echo total $(( $(date +%s) - start ))
  exit 0
fi
mkdir -p "$OUT" runs keep
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
keep() {  # the run's four files into keep/NAME
  mkdir -p "keep/$1"
  cp "runs/$1"/results.json "runs/$1"/metrics.jsonl "runs/$1"/fingerprint.json "runs/$1"/recipe.yaml "keep/$1/" 2>/dev/null
}
echo "=== fp8 $(date +%T)"
rm -rf runs/fp8
CUDA_VISIBLE_DEVICES=0 timeout "${STEP_TIMEOUT:-300}" \
  $MS run slice-1gpu --no-progress --out runs/fp8 precision=fp8 fp8.recipe=tensorwise fp8.format=hybrid \
  > "$OUT/fp8.log" 2>&1
echo "fp8 rc=$?" | tee -a "$OUT/fp8.log"
tail -5 "$OUT/fp8.log"
keep fp8
golden=benchmarks/results/gc-steady/manual1
left=$(( ${BUDGET_S:-420} - ($(date +%s) - start) ))
if [ "$left" -ge "${BF16_NEED_S:-150}" ]; then
  echo "=== bf16 $(date +%T) (${left} s left)"
  rm -rf runs/bf16
  CUDA_VISIBLE_DEVICES=0 timeout "$((left - 20))" \
    $MS run slice-1gpu --no-progress --out runs/bf16 > "$OUT/bf16.log" 2>&1
  echo "bf16 rc=$?" | tee -a "$OUT/bf16.log"
  tail -5 "$OUT/bf16.log"
  keep bf16
  [ -f runs/bf16/results.json ] && golden=runs/bf16
else
  echo "=== bf16 skipped (${left} s left)"
fi
echo "=== compare $golden runs/fp8"
$MS compare "$golden" runs/fp8 --json --no-plot > "$OUT/compare.json" 2>"$OUT/compare.err"; echo "compare rc=$?"
$MS compare benchmarks/results/gc-steady/manual1 runs/fp8 --json --no-plot > "$OUT/compare-manual1.json" 2>>"$OUT/compare.err"
echo "compare vs manual1 rc=$?"
tar czf "$OUT/runs.tgz" keep
echo "done in $(( $(date +%s) - start )) s"
