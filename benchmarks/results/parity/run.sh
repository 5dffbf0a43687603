#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (shared/device/te-stage.sh). The fingerprint.json beside this file is the stack that ran it.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.verify.parity --train-steps 3 --out parity-tp1.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --tp 2 --out parity-tp2.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --ep 2 --out parity-ep2.json
# packed rows (THD), pipeline, context and expert-tensor parallelism
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.verify.parity --packed --train-steps 3 --out parity-tp1-packed.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --pp 2 --train-steps 3 --out parity-pp2.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --cp 2 --train-steps 3 --out parity-cp2.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --cp 2 --packed --train-steps 3 --out parity-cp2-packed.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --etp 2 --train-steps 3 --out parity-etp2.json
torchrun --standalone --nproc-per-node 2 -m muse_stack.verify.parity --tp 2 --packed --train-steps 3 --out parity-tp2-packed.json
# on a lent 1 x H200 (the stack of ../det/proxy-1gpu-det-a/fingerprint.json, same lease):
# strict float32 parity with negative controls and the bf16 floor; adapters against the reference engine
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.verify.parity_strict --out parity-strict.json
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.verify.peft_parity --scheme lora --out peft-parity-lora.json
CUDA_VISIBLE_DEVICES=0 python3 -m muse_stack.verify.peft_parity --scheme dora --out peft-parity-dora.json
# (parity-strict-te-tf32.json and peft-parity-lora-te-tf32.json: the same commands before precision: fp32
#  ran TE's GEMMs in float32, kept as the measured effect of TE's TF32)
# parity-tp1-shipped.json: `h200.sh parity` (the command above, parity-tp1.json renamed) in the lease of
# ../slice-1gpu-mbs4-precision-aware, with the unweighted expert SwiGLU and the pre-scaled loss
OUT=/tmp/p bash benchmarks/scripts/h200.sh parity && cp /tmp/p/parity-tp1.json benchmarks/results/parity/parity-tp1-shipped.json
