#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
# packed rows built from the shipped chat fixture (needs the tokenizers package)
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.cli run proxy-1gpu data.kind=sft data.builder=packed 'data.files=[data/tiny-chat.jsonl]' data.tokenizer=data/tiny-tokenizer data.loss_mask=muse_spark batch.packed=true batch.seq_length=1024 --out runs/packed1 --no-progress
