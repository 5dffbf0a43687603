#!/usr/bin/env bash
# On a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install), from the project root:
OUT=benchmarks/results/ckpt-save bash benchmarks/scripts/h200.sh ckptsave
