#!/usr/bin/env bash
# One GPU with Transformer Engine 2.20.2 and megatron-core 0.19.2 in /tmp/site (benchmarks/scripts/stage-gpu.sh
# te-install), from the project root: one megatron-core MoE layer (alltoall, no CUDA graphs) per published model's
# per-GPU shapes at EP 8, and Qwen3-30B-A3B at EP 2 and 32, forward and backward, bf16 and FP8 current scaling.
# Then, on any machine, the fit the planner reads (CPU).
#   usage: OUT=dir bash benchmarks/results/host-sync-probe/run.sh
set -euo pipefail
OUT=${OUT:-bench-out}/host-sync-probe
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:.
python3 benchmarks/scripts/plan/host_sync_probe.py --model qwen3-30b-a3b deepseek-v3 gpt-oss-120b qwen3-235b-a22b \
  --ep 8 --precision bf16 fp8-cs --tokens 128 1024 4096 --repeats 5 --batch 10 --json "$OUT/host_sync.json"
python3 benchmarks/scripts/plan/host_sync_probe.py --model qwen3-30b-a3b --ep 2 32 --precision bf16 fp8-cs \
  --tokens 128 4096 --repeats 5 --batch 10 --json "$OUT/host_sync_ep.json"
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/nvidia-smi.csv"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|MHz|L3" > "$OUT/lscpu.txt"
# the fit (CPU): python benchmarks/scripts/plan/fit_host.py --write
# The whole decoder layer (its attention block and the MoE block), bf16 at EP 8, run on a later machine:
#   python3 benchmarks/scripts/plan/host_sync_probe.py --block layer --json "$OUT/host_sync_layer.json"
#   python3 benchmarks/scripts/plan/host_sync_probe.py --block layer --model deepseek-v3 gpt-oss-120b qwen3-235b-a22b \
#     --tokens 128 1024 --json "$OUT/host_sync_layer_models.json"
