#!/usr/bin/env bash
# The planner's step-time refit (issue 34): slice-1gpu as shipped and each neighbour of its settings,
# 11 engine_steps.py runs on one H200 in one call, then the fit on a CPU. See README.md here.
#
#   device (1 x H200, no registry), from the project root, once the b200 wheel set is installed in the
#   isolated venv of benchmarks/scripts/replay.sh (`replay.sh install b200`, `replay.sh te b200`):
#       OUT=dir bash benchmarks/results/plan-sweep/2026-12-02/run.sh device
#     writes dir/plan-sweep/runs/NAME.json (runs/ here) and dir/plan-sweep/fingerprint.json (here).
#     The committed runs came from `OUT=... T=120 bash benchmarks/scripts/h200.sh plansweep` in that
#     environment, with the fingerprint taken after it by `python3 -m muse_stack.cli fingerprint`
#     (h200.sh reads no T: its per-command limit is STEP_TIMEOUT, 900 s unless set); plansweep now
#     writes the fingerprint itself, inside h200.sh's environment.
#   here (CPU): bash benchmarks/results/plan-sweep/2026-12-02/run.sh       (the fit: fit.json)
set -euo pipefail
case "${1:-fit}" in
device)
  # the venv's python3 first on PATH and the set's CUDA library folders first on LD_LIBRARY_PATH;
  # cuDNN and NCCL homes in the venv (as the fingerprint records them)
  VENV=${VENV:-/tmp/replayenv-b200}
  SP=$("$VENV/bin/python" -E -s -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  export PATH=$VENV/bin:$PATH VIRTUAL_ENV=$VENV
  export LD_LIBRARY_PATH=$(ls -d "$SP"/nvidia/*/lib | paste -sd: -)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CUDNN_HOME=$SP/nvidia/cudnn CUDNN_PATH=$SP/nvidia/cudnn NCCL_HOME=$SP/nvidia/nccl
  # h200.sh puts /tmp/site first on PYTHONPATH: packages staged there would shadow the set's
  [ ! -e /tmp/site ] || { echo "/tmp/site exists: its packages would shadow the venv's (h200.sh's PYTHONPATH)" >&2; exit 1; }
  OUT=${OUT:?OUT=dir} bash benchmarks/scripts/h200.sh plansweep ;;
fit)
  python benchmarks/scripts/plan/fit_time.py --sweep benchmarks/results/plan-sweep/2026-12-02/runs \
    --json benchmarks/results/plan-sweep/2026-12-02/fit.json ;;
*) echo "usage: run.sh [device|fit]" >&2; exit 2 ;;
esac
