#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.cli run slice-1gpu layout.dispatcher=alltoall batch.mbs=2 fusions.compile_elementwise=false --out runs/slice-1gpu-mbs2-eager --no-progress
# (measured when the slice did not set fusions.compile_elementwise, which is eager as well; recipe.yaml beside this
# file is the recipe as it ran, its sha256 the fingerprint's run_inputs.recipe_sha256)
# (batch.mbs=1 layout.dispatcher=alltoall: the recipe's settings when this ran; it ships MBS 4 with allgather since)
