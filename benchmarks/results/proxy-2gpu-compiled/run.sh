#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). The fingerprint.json beside this file is the stack that ran it.
# h200.sh's `proxy2c` step runs the command (its environment; it keeps the run's files in $OUT/proxy-2gpu-compiled/):
set -euo pipefail
OUT=benchmarks/results bash benchmarks/scripts/h200.sh proxy2c
