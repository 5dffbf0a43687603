#!/usr/bin/env bash
# The h200 lock's hash-pinned wheel set (containers/locks/pylock.h200.toml) replayed on one H200 of a
# machine with no registry (its own image: python 3.12.3, torch 2.11). See benchmarks/results/replay/README.md.
#   here:   bash benchmarks/scripts/replay.sh prepare h200 && CHUNK=59m bash benchmarks/scripts/stage-gpu.sh pack .whl/replay-h200-src .whl/replay-h200-stage
#   device: bash benchmarks/scripts/stage-gpu.sh receive K .whl/replay-h200-stage     (one call per chunk, 43 calls)
#           bash benchmarks/scripts/replay.sh install h200  (91 packages, pip --require-hashes)
#           bash benchmarks/scripts/replay.sh te h200       (TE 2.17.0's PyTorch extension from the set's sdist)
#           bash benchmarks/scripts/replay.sh run h200      (selfcheck, fingerprint, slice-1gpu, parity)
set -euo pipefail
bash benchmarks/scripts/replay.sh install h200
bash benchmarks/scripts/replay.sh te h200
bash benchmarks/scripts/replay.sh run h200
