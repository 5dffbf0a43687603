#!/usr/bin/env bash
# slice-1gpu as it shipped then (MBS 4, allgather dispatcher, elementwise chains compiled; before the precision-aware
# optimizer and the unweighted expert SwiGLU, and `h200.sh slice` kept it here then): `muse-stack run slice-1gpu`,
# on a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site, from the project root. The same
# call ran parity (../../parity/parity-tp1-loss-chain.json), then this, then ../../bridge/, ../../remeasure/proxy-1gpu and
# ../../remeasure/packed-1gpu:
OUT=/tmp/final bash benchmarks/scripts/h200.sh parity slice bridge proxy1 packed   # slice -> /tmp/final/slice-1gpu
# the loss curve against the MBS 1 run of the engine before these changes, same data and seed (CPU):
muse-stack compare benchmarks/results/slice-1gpu-mbs1-compiled benchmarks/results/archive/slice-1gpu-mbs4-allgather --json --no-plot > benchmarks/results/archive/slice-1gpu-mbs4-allgather/compare-vs-slice-1gpu.json
