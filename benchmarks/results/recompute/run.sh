#!/usr/bin/env bash
# From the project root on a 2 x H200 machine with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site
# (benchmarks/scripts/stage-gpu.sh te-install). The fingerprint.json beside this file is the stack that ran it.
# peak memory of proxy-1gpu (6 steps) under each recompute setting; one run per GPU at a time. h200.sh's
# `recompute` step runs them (none, full, core-attn, moe-act, moe; it also runs core_attn + moe_act together,
# not kept here) and keeps each run's files in $OUT/recompute/<setting>/, its log in $OUT/rc-<setting>.log:
set -euo pipefail
OUT=/tmp/bench bash benchmarks/scripts/h200.sh recompute
