#!/usr/bin/env bash
# Side by side on one GPU, in one sitting: `muse-stack run slice-1gpu` and Megatron-Bridge 0.6.2's own pretrain
# loop on the same shapes (benchmarks/scripts/bridge_slice.py; the settings that still differ are listed in
# benchmarks/results/side-by-side/README.md), alternated three times each (runner, Bridge, runner, Bridge, ...),
# each its own process. Kept per run: results.json, metrics.jsonl, fingerprint.json, recipe.yaml (runner) and
# bridge-slice.json (Bridge).
# Needs TE 2.20.2 + megatron-core 0.19.2 in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install) and Bridge's
# wheels installed by `bash benchmarks/scripts/bridge/stage.sh install DIR` into /tmp/site-bridge.
#   usage: OUT=dir [SHAPE_OVERRIDES="a.b=c ..."] [RUNNER_OVERRIDES="a.b=c ..."] bash benchmarks/results/side-by-side/run.sh [N]
#          (N pairs, default 3)
# SHAPE_OVERRIDES: recipe overrides for both sides (a smaller slice that fits an 80 GB card: the runner's recipe.yaml
#   and Bridge's bridge-slice.json `overrides` record them); RUNNER_OVERRIDES: the runner's runs only; empty: as shipped.
# Bridge gets the engine's own optimizer and DDP mapping of the recipe (the precision-aware optimizer included) and
# gradient_accumulation_fusion on, its output layer's accumulation by TE's GEMM where APEX is absent
# (bridge_slice.py --grad-accum-fusion te, the default).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}/side-by-side
mkdir -p "$OUT" runs
for i in $(seq 1 "${1:-3}"); do
  echo "=== runner$i $(date +%T)"
  rm -rf "runs/sbs-runner$i"
  PYTHONPATH=/tmp/site:${PYTHONPATH:-}:. CUDA_VISIBLE_DEVICES=0 timeout 300 \
    python3 -m muse_stack.cli run slice-1gpu ${SHAPE_OVERRIDES:-} ${RUNNER_OVERRIDES:-} --no-progress --out "runs/sbs-runner$i" 2>&1 | tail -3
  mkdir -p "$OUT/runner$i"
  cp "runs/sbs-runner$i"/{results.json,metrics.jsonl,fingerprint.json,recipe.yaml} "$OUT/runner$i/" 2>/dev/null
  echo "=== bridge$i $(date +%T)"
  mkdir -p "$OUT/bridge$i"
  PYTHONPATH=/tmp/site-bridge:/tmp/site:${PYTHONPATH:-}:. CUDA_VISIBLE_DEVICES=0 timeout 300 \
    python3 benchmarks/scripts/bridge_slice.py slice-1gpu ${SHAPE_OVERRIDES:-} --steps 30 --warmup 10 --out "$OUT/bridge$i/bridge-slice.json" \
    > "$OUT/bridge$i/bridge-iterations.log" 2>&1
  echo "rc=$?"; tail -2 "$OUT/bridge$i/bridge-iterations.log"
done
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/nvidia-smi.csv"
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
runner = [json.loads(p.read_text()) for p in sorted(out.glob("runner*/results.json"))]
bridge = [json.loads(p.read_text()) for p in sorted(out.glob("bridge*/bridge-slice.json"))]
r = [x["tokens_per_s_per_gpu"] for x in runner]
b = [x.get("tokens_per_s_per_gpu") or x.get("tokens_per_s") for x in bridge]
summary = {"runner_tokens_per_s": r, "bridge_tokens_per_s": b,
           "runner_median": statistics.median(r) if r else None, "bridge_median": statistics.median(b) if b else None,
           "runner_mfu": [x["mfu"] for x in runner],
           "runner_worst_step_ratio": [x.get("step_time_worst_ratio") for x in runner]}
if r and b:
    summary["ratio_of_medians"] = summary["runner_median"] / summary["bridge_median"]
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
PY
