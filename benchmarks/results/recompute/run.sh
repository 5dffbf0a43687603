#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
# peak memory of proxy-1gpu (6 steps) under each recompute setting; one run per GPU at a time
rc() { CUDA_VISIBLE_DEVICES=$2 MASTER_PORT=$((29517 + $2)) python3 -m muse_stack.cli run proxy-1gpu "${@:3}" --steps 6 --out "runs/rc-$1" --no-progress; }
rc none 0 & rc full 1 recompute.granularity=full & wait
rc core-attn 0 recompute.granularity=selective "recompute.modules=[core_attn]" &
rc moe-act 1 recompute.granularity=selective "recompute.modules=[moe_act]" & wait
rc moe 0 recompute.granularity=selective "recompute.modules=[moe]"
