#!/usr/bin/env bash
# proxy-1gpu and packed-1gpu remeasured in the lease of ../slice-1gpu-mbs4 (see its run.sh), then compared (CPU)
# with the committed runs of the same recipes (../proxy-1gpu, ../packed-1gpu):
OUT=/tmp/final bash benchmarks/h200.sh proxy1 packed
muse-stack compare benchmarks/proxy-1gpu benchmarks/remeasure/proxy-1gpu --json --no-plot > benchmarks/remeasure/proxy-1gpu-compare.json
muse-stack compare benchmarks/packed-1gpu benchmarks/remeasure/packed-1gpu --json --no-plot > benchmarks/remeasure/packed-1gpu-compare.json
# eager-restored/: the same two runs in the lease of ../slice-1gpu-shipped (see its run.sh), kept into that folder:
INTO=remeasure/eager-restored/ OUT=benchmarks bash benchmarks/h200.sh proxy1 packed
