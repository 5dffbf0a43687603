#!/usr/bin/env bash
# Three `muse-stack run slice-1gpu` as shipped, back to back, on one H200 in the isolated b200 wheel set of
# benchmarks/scripts/replay.sh (after `replay.sh install b200` and `te b200` in the same lease; the background
# flash-attn build stopped with SIGSTOP meanwhile).
V=/tmp/replayenv-b200; SP=$V/lib/python3.12/site-packages
export PATH=$V/bin:$PATH LD_LIBRARY_PATH=$(ls -d $SP/nvidia/*/lib | paste -sd:):${LD_LIBRARY_PATH:-} \
  CUDNN_HOME=$SP/nvidia/cudnn CUDNN_PATH=$SP/nvidia/cudnn NVRTC_HOME=$SP/nvidia/cu13 CURAND_HOME=$SP/nvidia/cu13 \
  NCCL_HOME=$SP/nvidia/nccl CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
D=${OUT:-bench-out}/slice-1gpu-b200-set
for i in 1 2 3; do
  rm -rf runs/r$i
  timeout 120 python3 -E -s -m muse_stack.cli run slice-1gpu --out runs/r$i --no-progress
  mkdir -p $D/run$i && cp runs/r$i/{results.json,metrics.jsonl,fingerprint.json,recipe.yaml} $D/run$i/
done
