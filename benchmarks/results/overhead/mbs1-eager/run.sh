#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). The fingerprint.json beside this file is the stack that ran it.
# h200.sh's `overhead` step: overhead-slice-mbs1.json (MBS 1, eager), then the compiled MBS 2 half (../mbs2-compiled/)
set -euo pipefail
OUT=benchmarks/results/overhead/mbs1-eager bash benchmarks/scripts/h200.sh overhead
# (measured when eager was the slice's default, as `overhead.py slice-1gpu`; the step pins MBS 1, alltoall and eager)
