#!/usr/bin/env bash
# On a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install), from the project root:
# where two deterministic runs part ways (probe-diff.json; probe-a/b.json stay on the machine)
OUT=/tmp/det bash benchmarks/scripts/h200.sh detprobe
# two numerics.deterministic runs and one default run of proxy-1gpu (20 steps), with the engine's CPU seed
OUT=/tmp/det bash benchmarks/scripts/h200.sh det-proxy
# before-seed-fix/slice-1gpu-det-* predates the CPU seed (earlier lease; its compare was made on a CPU:
# muse-stack compare det/slice-1gpu-det-a det/slice-1gpu-det-b --json --no-plot). The slice pair with the seed,
# on the recipe as it ships now, and its default run (the lease of ../archive/slice-1gpu-mbs4-precision-aware):
OUT=/tmp/det bash benchmarks/scripts/h200.sh det-slice
