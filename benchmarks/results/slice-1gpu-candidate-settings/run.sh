#!/usr/bin/env bash
# On a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install), from the
# project root: slice-1gpu's step time under each candidate setting, benchmarks/scripts/engine_steps.py, 30 steps, window
# 11-30, one process each, one lease. The files' "overrides" are as typed then, when the recipe shipped MBS 1 with
# the alltoall dispatcher (the commands below pin that, so they measure the same today).
OUT=benchmarks/results/slice-1gpu-candidate-settings bash benchmarks/scripts/h200.sh levers    # lever-base, -mbs2, -mbs4, -mbs4-cutlass, -mbs4-connections8
OUT=benchmarks/results/slice-1gpu-candidate-settings bash benchmarks/scripts/h200.sh levers2   # lever-mbs8, -mbs4-allgather, profile-mbs4 (-> ../slice-1gpu-mbs1-compiled/)
# a later lease, the recipe as it ships now (MBS 4, allgather), on its first machine:
OUT=benchmarks/results/slice-1gpu-candidate-settings bash benchmarks/scripts/h200.sh levers3   # lever3-base (--weighted-swiglu), -swiglu, -precision-aware, -mbs8
# on the second machine of that lease, before ../archive/slice-1gpu-mbs4-precision-aware's run (see its run.sh):
OUT=benchmarks/results/slice-1gpu-candidate-settings bash benchmarks/scripts/h200.sh levers4   # lever3-precision-aware-fp32 (the recipe as shipped)
