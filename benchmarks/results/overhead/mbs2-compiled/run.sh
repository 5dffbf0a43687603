#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
# this fingerprint is the slice-1gpu MBS 2 run made just before, in the same call on the same GPU
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/scripts/overhead.py slice-1gpu batch.mbs=2 --steps 8 --warmup 3 --out overhead-slice-mbs2-compiled.json
# (measured as `overhead.py slice-1gpu batch.mbs=2 fusions.compile_elementwise=true` on GPU 1 while GPU 0 ran
# the slice at MBS 1; compiled is the recipe's own setting)
