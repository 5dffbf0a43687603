#!/usr/bin/env bash
# On a lent 1 x H200 with TE 2.20.2 + megatron-core 0.19.2 staged in /tmp/site (benchmarks/scripts/stage-gpu.sh te-install), from the project root:
# muse-stack run with lora-64's adapters on slice-1gpu (full/), interrupted + resumed (part/), adapter export
OUT=/tmp/peft bash benchmarks/scripts/h200.sh peftrun
# adapters against full SFT of the slice, 30 steps each (slice-lora64.json, slice-full.json)
OUT=/tmp/peft bash benchmarks/scripts/h200.sh peftslice
