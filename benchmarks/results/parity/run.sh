#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). The fingerprint.json beside this file is the stack that ran it.
# h200.sh's parity steps run the commands (TP 1, then TP 2 and EP 2 on both GPUs):
set -euo pipefail
OUT=benchmarks/results/parity bash benchmarks/scripts/h200.sh parity parity2   # parity-tp1, -tp2, -ep2
# packed rows (THD), pipeline, context and expert-tensor parallelism (kept in $OUT/parity/):
OUT=benchmarks/results bash benchmarks/scripts/h200.sh parity3   # parity-tp1-packed, -pp2, -cp2, -cp2-packed, -etp2, -tp2-packed
# on a lent 1 x H200 (the stack of ../det/proxy-1gpu-det-a/fingerprint.json, same lease):
# strict float32 parity with negative controls and the bf16 floor; adapters against the reference engine
OUT=benchmarks/results/parity bash benchmarks/scripts/h200.sh strict peftparity   # parity-strict, peft-parity-lora, -dora
# (parity-strict-te-tf32.json and peft-parity-lora-te-tf32.json: the same commands before precision: fp32
#  ran TE's GEMMs in float32, kept as the measured effect of TE's TF32)
# parity-tp1-shipped.json: `h200.sh parity` (the command above, parity-tp1.json renamed) in the lease of
# ../archive/slice-1gpu-mbs4-precision-aware, with the unweighted expert SwiGLU and the pre-scaled loss
OUT=/tmp/p bash benchmarks/scripts/h200.sh parity && cp /tmp/p/parity-tp1.json benchmarks/results/parity/parity-tp1-shipped.json
