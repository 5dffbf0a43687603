#!/usr/bin/env bash
# The tiny-cpu demo (`make demo`'s run) as the reference a newcomer's run is compared with, and the same run
# with one setting of the CPU changed at a time, on one machine (AMD EPYC, 2 logical CPUs, AVX-512):
# ATen's kernels held to AVX2 or to no vector instructions, one thread, MKL held to AVX2. From the repository.
set -euo pipefail
D=benchmarks/results/demo-tiny-cpu
run() { # run NAME [VAR=VALUE]: tiny-cpu into D/NAME, keeping the files compare reads
  local name=$1; shift
  rm -rf "$D/$name"
  env "$@" .venv/bin/muse-stack run tiny-cpu --out "$D/$name"
  rm -rf "$D/$name"/checkpoints "$D/$name"/tensorboard "$D/$name"/*.png "$D/$name"/run.log
}
run reference
run cpu-avx2 ATEN_CPU_CAPABILITY=avx2
run cpu-default ATEN_CPU_CAPABILITY=default
run one-thread OMP_NUM_THREADS=1
run mkl-avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
for v in cpu-avx2 cpu-default one-thread mkl-avx2; do
  .venv/bin/muse-stack compare "$D/reference" "$D/$v" --no-plot
done
PYTHONPATH=. .venv/bin/python benchmarks/scripts/render.py   # this folder's README and the project README's example from the runs
