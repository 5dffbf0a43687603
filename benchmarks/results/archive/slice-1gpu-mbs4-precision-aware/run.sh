#!/usr/bin/env bash
# slice-1gpu as shipped (MBS 4, allgather, chains compiled, unweighted expert SwiGLU, precision-aware optimizer
# with a separate fp32 master): `muse-stack run slice-1gpu`, on a lent 1 x H200 with TE 2.20.2 + megatron-core
# 0.19.2 staged in /tmp/site, from the project root. One call ran, in order: slice (kept as run1/: one 1.117 s
# step put it at 49.15%, so slice8 followed; the planner refused it), proxy1 and packed (../../remeasure/eager-restored/),
# levers4 (../../slice-1gpu-candidate-settings/lever3-precision-aware-fp32.json) and profile2 (../../slice-1gpu-mbs1-compiled/profile-shipped.json). The
# next calls on the same machine ran slice again (this folder), parity (../../parity/parity-tp1-shipped.json) and
# det-slice (../../det/slice-1gpu-*):
OUT=/tmp/y bash benchmarks/scripts/h200.sh slice slice8; OUT=/tmp/y INTO=remeasure/eager-restored/ bash benchmarks/scripts/h200.sh proxy1 packed
OUT=/tmp/y bash benchmarks/scripts/h200.sh levers4 profile2
OUT=/tmp/z bash benchmarks/scripts/h200.sh slice
OUT=/tmp/p bash benchmarks/scripts/h200.sh parity
OUT=/tmp/d bash benchmarks/scripts/h200.sh det-slice
# before that, on the lease's first machine: levers3 (../../slice-1gpu-candidate-settings/) and resume1 (../../resume-1gpu-precision-aware/)
OUT=/tmp/x bash benchmarks/scripts/h200.sh levers3 resume1
# the loss curves against the committed runs, same data and seed (CPU):
muse-stack compare benchmarks/results/archive/slice-1gpu-mbs4-allgather benchmarks/results/archive/slice-1gpu-mbs4-precision-aware --json --no-plot > benchmarks/results/archive/slice-1gpu-mbs4-precision-aware/compare-vs-slice-1gpu-mbs4.json
muse-stack compare benchmarks/results/proxy-1gpu benchmarks/results/remeasure/eager-restored/proxy-1gpu --json --no-plot > benchmarks/results/remeasure/eager-restored/proxy-1gpu-compare.json
muse-stack compare benchmarks/results/packed-1gpu benchmarks/results/remeasure/eager-restored/packed-1gpu --json --no-plot > benchmarks/results/remeasure/eager-restored/packed-1gpu-compare.json
