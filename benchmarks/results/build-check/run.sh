#!/usr/bin/env bash
# The build checks (tests/system/test_build_kernels.py), timed: writes durations.txt beside this file.
# Run from the repository root after `make setup`. A first run also downloads about 2.4 GB into
# ~/.cache/muse-stack/build-check (run it twice to time the cached case).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/results/build-check/durations.txt
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) cache ${MUSE_STACK_CACHE:-~/.cache/muse-stack}/build-check; $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  start=$(date +%s)
  .venv/bin/python -m pytest -q -m build --durations=0 -p no:cacheprovider tests/system/test_build_kernels.py 2>&1
  echo "# wall: $(( $(date +%s) - start )) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out"
