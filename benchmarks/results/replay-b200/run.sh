#!/usr/bin/env bash
# The b200 lock's hash-pinned wheel set (containers/locks/pylock.b200.toml) replayed on one H200 of a
# machine with no registry (its own image: python 3.12.3, torch 2.11). See benchmarks/results/replay/README.md.
#   here:   bash benchmarks/scripts/replay.sh prepare b200 && CHUNK=59m bash benchmarks/scripts/stage-gpu.sh pack .whl/replay-b200-src .whl/replay-b200-stage
#   device: bash benchmarks/scripts/stage-gpu.sh receive K .whl/replay-b200-stage     (one call per chunk, 43 calls)
#           bash benchmarks/scripts/replay.sh install b200  (91 packages, pip --require-hashes)
#           bash benchmarks/scripts/replay.sh te b200       (TE 2.17.0's PyTorch extension from the set's sdist)
#           bash benchmarks/scripts/replay.sh run b200      (selfcheck, fingerprint, slice-1gpu, parity)
set -euo pipefail
bash benchmarks/scripts/replay.sh install b200
bash benchmarks/scripts/replay.sh te b200
bash benchmarks/scripts/replay.sh run b200
