#!/usr/bin/env bash
# On a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site (shared/device/te-stage.sh), from the project root:
# two numerics.deterministic runs and one default run of proxy-1gpu and slice-1gpu (20 steps); the
# slice-1gpu-det compare was made afterwards on a CPU: muse-stack compare det/slice-1gpu-det-a det/slice-1gpu-det-b --json --no-plot
OUT=/tmp/det bash benchmarks/h200.sh det
