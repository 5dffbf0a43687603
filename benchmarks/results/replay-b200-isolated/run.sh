#!/usr/bin/env bash
# The b200 lock's whole hash-pinned wheel set (containers/locks/pylock.b200.toml, 125 packages) replayed on
# one lent H200 that reaches no registry, in an isolated interpreter (benchmarks/scripts/replay.sh; its
# header says how each step works). See benchmarks/results/replay/README.md, "The isolated replay".
#   here:   bash benchmarks/scripts/replay.sh prepare b200      # 133 files, 3,427,887,117 bytes, hash-checked
#           CHUNK=50m bash benchmarks/scripts/stage-gpu.sh pack .whl/replay-b200-src .whl/replay-b200-stage   # 66 chunks
#   device: bash benchmarks/scripts/stage-gpu.sh receive K .whl/replay-b200-stage   # K = 0..64, one call each
#           (call 66, the last chunk with the manifest)  then the steps below, one call each
#   after:  the device's $OUT/replay-b200.tgz unpacked here; the CPU re-checks at the end
set -euo pipefail
bash benchmarks/scripts/stage-gpu.sh receive 65 .whl/replay-b200-stage
bash benchmarks/scripts/replay.sh install b200      # venv --without-pip, 123 wheels, --require-hashes
bash benchmarks/scripts/replay.sh fa-start b200     # flash-attn from the set's sdist, FLASH_ATTN_CUDA_ARCHS=90, background
bash benchmarks/scripts/replay.sh te b200           # TE 2.17.0's PyTorch extension from the set's sdist, 90;100
bash benchmarks/scripts/replay.sh check b200        # stack selfcheck --image, then the isolation proof
bash benchmarks/scripts/replay.sh run b200 || true  # slice-1gpu, isolation of its fingerprint, audit, diff, compare, parity
FA_WAIT=210 bash benchmarks/scripts/replay.sh fa-status b200   # unfinished: fa-unfinished.txt
# CPU, from this folder's files:
#   muse-stack audit benchmarks/results/replay-b200-isolated/fingerprint.json --recipe attune-b200   # exit 2: GPUs per node
#   muse-stack diff benchmarks/results/replay-b200-isolated/fingerprint.json benchmarks/results/replay-h200/fingerprint.json
#   muse-stack stack check gb200 --strict; ... b200; ... h200
