#!/usr/bin/env bash
# slice-1gpu-mm with the vision tower's grouped attention (one call per group size, matmuls in bf16), on one
# H200, in the isolated b200 wheel set of benchmarks/scripts/replay.sh (torch 2.14.1, TE 2.17.0,
# megatron-core 0.19.0): after `replay.sh install b200` and `replay.sh te b200` in the same lease,
V=/tmp/replayenv-b200; SP=$V/lib/python3.12/site-packages
export PATH=$V/bin:$PATH LD_LIBRARY_PATH=$(ls -d $SP/nvidia/*/lib | paste -sd:):${LD_LIBRARY_PATH:-} \
  CUDNN_HOME=$SP/nvidia/cudnn CUDNN_PATH=$SP/nvidia/cudnn NVRTC_HOME=$SP/nvidia/cu13 CURAND_HOME=$SP/nvidia/cu13 \
  NCCL_HOME=$SP/nvidia/nccl
OUT=${OUT:-bench-out} bash benchmarks/results/mm-slice/run.sh slice   # -> $OUT/mm-slice/: results, metrics, fingerprint, plan
