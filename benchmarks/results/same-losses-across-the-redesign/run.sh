#!/usr/bin/env bash
# The megatron-core engine trains the same before and after the product and the lab were taken apart (the recipe
# resolved once, the engine options as one table, the trainer owning the step's state, calibration as data): one GPU,
# slice-1gpu with 8 experts (top 2) so that it fits an H100, run by the tree of commit bacd0f2 (BEFORE: `git archive
# bacd0f2 muse_stack recipes data benchmarks/scripts pyproject.toml | tar -x -C DIR`) and by this checkout.
#   STEP=det:   10 steps each in numerics.deterministic mode: every step's loss and grad norm compared bit for bit.
#   STEP=gpu-tests: the GPU tests of this checkout, stopping at the first failure, then all but the one known to fail
#               (test_same_weights_same_loss_with_towers: its hand-set bound, an open issue).
#   STEP=speed: 30 steps each as shipped (window and warm-up as `muse-stack run` reports them), before, after, before,
#               after, each its own process.
# Needs TE 2.20.2 + megatron-core 0.19.2 in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install).
#   usage: BEFORE=DIR OUT=dir STEP=det|gpu-tests|speed bash benchmarks/results/same-losses-across-the-redesign/run.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
OUT=${OUT:-bench-out}; BEFORE=$(realpath "${BEFORE:?the tree of bacd0f2}"); HERE=$(pwd)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' || echo H200)
SMALL="model.overrides.num_local_experts=8 model.overrides.num_experts_per_tok=2 hardware.gpu=$GPU"
D=/tmp/redesign; mkdir -p "$D" "$OUT"
run() { # TREE NAME OVERRIDES...: one `muse-stack run slice-1gpu` of that tree, its record kept in $D/NAME
  local tree=$1 name=$2; shift 2
  echo "=== $name $(date +%T)"
  rm -rf "/tmp/runs/$name"
  (cd "$tree" && PYTHONPATH=/tmp/site:. timeout 420 python3 -m muse_stack.cli run slice-1gpu $SMALL "$@" --no-progress \
     --out "/tmp/runs/$name") 2>&1 | tail -4
  mkdir -p "$D/$name"
  cp "/tmp/runs/$name"/{results.json,metrics.jsonl,fingerprint.json,recipe.yaml} "$D/$name/" 2>/dev/null
}
case "${STEP:-det}" in
det)
  run "$BEFORE" before-deterministic numerics.deterministic=true training.steps=10
  run "$HERE" after-deterministic numerics.deterministic=true training.steps=10
  python3 - "$D" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
rows = {n: [json.loads(l) for l in (d / n / "metrics.jsonl").read_text().splitlines() if l.strip()]
        for n in ("before-deterministic", "after-deterministic")}
a, b = rows["before-deterministic"], rows["after-deterministic"]
same = [(x["step"], x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]) for x, y in zip(a, b)]
print(json.dumps({"steps": len(same), "bitwise_equal_steps": sum(s for _, s in same),
                  "before_losses": [x["loss"] for x in a], "after_losses": [y["loss"] for y in b]}))
PY
  ;;
gpu-tests)
  # every test marked gpu (tests/gpu/ and the GPU tests of the other folders)
  KNOWN=$(grep -l "def test_same_weights_same_loss_with_towers" -r tests)::test_same_weights_same_loss_with_towers
  PYTHONPATH=/tmp/site:. timeout 200 python3 -m pytest -x -q -p no:cacheprovider -m gpu tests 2>&1 | tail -3 \
    | tee "$D/gpu-tests.txt"
  PYTHONPATH=/tmp/site:. timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu --deselect "$KNOWN" tests 2>&1 \
    | grep -E "passed|failed|FAILED|ERROR" | tee -a "$D/gpu-tests.txt"
  ;;
speed)
  for i in 1 2; do
    run "$BEFORE" "before-$i" training.steps=30
    run "$HERE" "after-$i" training.steps=30
  done
  ;;
esac
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$D/nvidia-smi.csv"
tar czf "$OUT/redesign-${STEP:-det}.tgz" -C "$D" .
