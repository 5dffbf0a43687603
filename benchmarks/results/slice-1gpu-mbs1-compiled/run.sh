#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.cli run slice-1gpu batch.mbs=1 layout.dispatcher=alltoall --out runs/slice-1gpu --no-progress
# (measured as `slice-1gpu fusions.compile_elementwise=true`, which is the recipe's own setting)
# profile.json / profile.md (a lent 1 x H200, the same stack): OUT=benchmarks/results/slice-1gpu-mbs1-compiled bash benchmarks/scripts/h200.sh profile
# (batch.mbs=1 layout.dispatcher=alltoall: the recipe's settings when this ran; it ships MBS 4 with allgather since)
# profile-mbs4.json: OUT=benchmarks/results/levers bash benchmarks/scripts/h200.sh levers2 (then moved here); profile.md describes both
