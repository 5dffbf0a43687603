#!/usr/bin/env bash
# Megatron-Bridge 0.6.2's own pretrain loop on slice-1gpu's shapes and settings, on a lent 1 x H200, in the lease of
# ../archive/slice-1gpu-mbs4-allgather (same machine, same stack: TE 2.20.2, megatron-core 0.19.2, torch 2.11.0+cu130; that folder's
# fingerprint.json), right after it. Here: bash benchmarks/scripts/bridge/stage.sh download .whl/bridge; carry .whl/bridge
# in one device call and copy it to /tmp/bridge; then on the device:
BRIDGE_WHEELS=/tmp/bridge OUT=benchmarks/results/bridge bash benchmarks/scripts/h200.sh bridge   # bridge-slice.json
# bridge-iterations.log: Bridge's own log lines for iterations 10-30 from the same run
