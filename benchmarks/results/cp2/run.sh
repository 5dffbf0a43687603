#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
torchrun --standalone --nproc-per-node 2 -m muse_stack.cli run proxy-2gpu layout.ep=1 layout.cp=2 layout.cp_comm_type=a2a --out runs/cp2 --no-progress
