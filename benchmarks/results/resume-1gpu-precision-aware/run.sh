#!/usr/bin/env bash
# On a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site, from the project root: proxy-1gpu
# with 8 experts (top 2), 6 steps, under the precision-aware optimizer with int16 remainders: uninterrupted
# (resume1-full), and interrupted after step 3 then resumed (resume1-part); the checkpoint's size in resume1-sizes.txt
OUT=/tmp/x bash benchmarks/scripts/h200.sh resume1
# the same interrupted-and-resumed run with FusedAdam's separate fp32 master (the setting slice-1gpu ships), in a
# later call of the same lease (the device time ran out before its own uninterrupted run finished), kept in
# fp32-master-part/ and compared (CPU) with the uninterrupted run above:
SMALL="model.overrides.num_local_experts=8 model.overrides.num_experts_per_tok=2"
muse-stack run proxy-1gpu $SMALL optimizer.precision_aware=true optimizer.param_remainders=false --steps 6 \
  --stop-after 3 --out runs/r2-part --no-progress; du -sb runs/r2-part/checkpoints/*/ > fp32-master-sizes.txt
muse-stack run --resume runs/r2-part --no-progress
muse-stack compare benchmarks/results/resume-1gpu-precision-aware/resume1-full benchmarks/results/resume-1gpu-precision-aware/fp32-master-part --json --no-plot > benchmarks/results/resume-1gpu-precision-aware/fp32-master-compare.json
# the same round trip with the fp32 master stepped by the Triton Adam step (the engine as of benchmarks/results/adam/
# and embedgrad/), its own uninterrupted run in the same call (resumeadam-full, resumeadam-part, resumeadam-sizes.txt,
# resumeadam-compare.json):
OUT=/tmp/x bash benchmarks/scripts/h200.sh resumeadam
