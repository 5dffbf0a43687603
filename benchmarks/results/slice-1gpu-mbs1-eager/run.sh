#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). The fingerprint.json beside this file is the stack that ran it.
# h200.sh's `slicee` step runs the command (its environment; it keeps the run's files in $OUT/slice-1gpu-mbs1-eager/):
# (the step pins the recipe's settings of then: MBS 1 or 2, alltoall, no precision-aware optimizer)
set -euo pipefail
OUT=benchmarks/results bash benchmarks/scripts/h200.sh slicee
# (measured when the slice did not set fusions.compile_elementwise, which is eager as well; recipe.yaml beside this
# file is the recipe as it ran, its sha256 the fingerprint's run_inputs.recipe_sha256)
# (batch.mbs=1 layout.dispatcher=alltoall: the recipe's settings when this ran; it ships MBS 4 with allgather since)
