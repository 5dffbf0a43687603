#!/usr/bin/env bash
# proxy-1gpu and packed-1gpu remeasured in the lease of ../archive/slice-1gpu-mbs4-allgather (see its run.sh), then compared (CPU)
# with the committed runs of the same recipes (../proxy-1gpu, ../packed-1gpu):
OUT=/tmp/final bash benchmarks/scripts/h200.sh proxy1 packed
muse-stack compare benchmarks/results/proxy-1gpu benchmarks/results/remeasure/proxy-1gpu --json --no-plot > benchmarks/results/remeasure/proxy-1gpu-compare.json
muse-stack compare benchmarks/results/packed-1gpu benchmarks/results/remeasure/packed-1gpu --json --no-plot > benchmarks/results/remeasure/packed-1gpu-compare.json
# eager-restored/: the same two runs in the lease of ../archive/slice-1gpu-mbs4-precision-aware (see its run.sh), kept into that folder:
INTO=remeasure/eager-restored/ OUT=benchmarks/results bash benchmarks/scripts/h200.sh proxy1 packed
