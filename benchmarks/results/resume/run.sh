#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install); the same as `bash benchmarks/scripts/h200.sh resume resumectl`. Each run folder's
# fingerprint.json is the stack that ran it (fingerprint.resumed.json: the stack of the resumed half).
# Per layout: an uninterrupted 6-step run (full), a run interrupted after step 3 with a dist-checkpoint
# and resumed from it (part), and a second uninterrupted run (again) that measures the run-to-run spread.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH=/tmp/site:.
SMALL="model.overrides.num_local_experts=8 model.overrides.num_experts_per_tok=2"
two() { torchrun --standalone --nproc-per-node 2 "$@"; }
for tag in ep2 pp2; do
  lay="layout.ep=2"; [ $tag = pp2 ] && lay="layout.ep=1 layout.pp=2 layout.pp_layers=[1,3]"
  two -m muse_stack.cli run proxy-2gpu $SMALL $lay --steps 6 --out runs/resume-$tag-full --no-progress
  two -m muse_stack.cli run proxy-2gpu $SMALL $lay --steps 6 --stop-after 3 --out runs/resume-$tag-part --no-progress || true
  two -m muse_stack.cli run --resume runs/resume-$tag-part --no-progress
  two -m muse_stack.cli run proxy-2gpu $SMALL $lay --steps 6 --out runs/resume-$tag-again --no-progress
  python3 -m muse_stack.cli compare runs/resume-$tag-full runs/resume-$tag-part --json --no-plot > $tag-resumed-vs-full.json
  python3 -m muse_stack.cli compare runs/resume-$tag-full runs/resume-$tag-again --json --no-plot > $tag-again-vs-full.json
done
