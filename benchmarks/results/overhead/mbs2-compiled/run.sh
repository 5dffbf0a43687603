#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). The fingerprint.json beside this file is the stack that ran it.
# this fingerprint is the slice-1gpu MBS 2 run made just before, in the same call on the same GPU
# h200.sh's `overheadc` step (the compiled MBS 2 half of `overhead`): overhead-slice-mbs2-compiled.json
set -euo pipefail
OUT=benchmarks/results/overhead/mbs2-compiled bash benchmarks/scripts/h200.sh overheadc
# (measured as `overhead.py slice-1gpu batch.mbs=2 fusions.compile_elementwise=true` on GPU 1 while GPU 0 ran
# the slice at MBS 1; compiled is the recipe's own setting)
