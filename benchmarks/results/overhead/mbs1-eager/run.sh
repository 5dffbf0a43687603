#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/scripts/overhead.py slice-1gpu fusions.compile_elementwise=false --steps 8 --warmup 3 --out overhead-slice-mbs1.json
# (measured when eager was the slice's default, as `overhead.py slice-1gpu`)
