#!/usr/bin/env bash
# Replay a lock's hash-pinned wheel set on a GPU machine that reaches no registry, then run the
# recorded stack: self-check, fingerprint, slice-1gpu and the parity check. One lock at a time.
#
#   here:   bash benchmarks/scripts/replay.sh prepare LOCK      # download what the machine lacks, hash-checked
#           bash ../shared/device/stage.sh pack "$STAGE_SRC" .stage   # then one device call per chunk
#   device: bash benchmarks/scripts/replay.sh install LOCK      # unpack, pip install --require-hashes
#           bash benchmarks/scripts/replay.sh te LOCK           # build TE's PyTorch extension from the set's sdist
#           bash benchmarks/scripts/replay.sh run LOCK          # selfcheck, fingerprint, slice-1gpu, parity
#
# The machine's own image (python 3.12.3, torch 2.11) stays in place; the set's packages go to
# /tmp/lockenv, first on PYTHONPATH, so they shadow the image's. What is not staged (the CUDA
# libraries the image already has at the set's version) is read from the image, and `install`
# lists every set package whose installed version differs, staged or not.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cmd=${1:?usage: replay.sh prepare|install|te|run LOCK}
lock=${2:?LOCK (b200, h200)}
ENV=/tmp/lockenv
SRC=${STAGE_SRC:-/tmp/stage-src}
OUT=${OUT:-replay-out}
PYLOCK=containers/locks/pylock.$lock.toml
PY=${PY:-python3}

staged_requirements() { # hash-pinned lines for the staged wheels (sdists are built by `te`)
  $PY - "$PYLOCK" "$SRC/wheels" <<'PY'
import os, sys
sys.path.insert(0, "muse_stack/stack")
import pylock
_, pkgs = pylock.load(sys.argv[1])
files = set(os.listdir(sys.argv[2]))
names = {pylock.canonical(f.split("-")[0]) for f in files if f.endswith(".whl")}
print("\n".join(pylock.requirement_lines(pkgs, only=names & set(pkgs))))
PY
}

case "$cmd" in
prepare)  # here: the set's files that the device image lacks or has in another version
  # (the CUDA libraries torch 2.11's wheel pins at the set's versions are left to the image)
  SRC=${STAGE_SRC:-.stage-src}
  mkdir -p "$SRC/wheels"
  ${PY} - "$PYLOCK" "$SRC/wheels" <<'PY'
import hashlib, os, sys, urllib.request
sys.path.insert(0, "muse_stack/stack")
import pylock
_, pkgs = pylock.load(sys.argv[1])
on_device = {"nvidia-cufft", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cuda-nvrtc", "nvidia-curand",
             "nvidia-nvshmem-cu13", "nvidia-cuda-cupti", "nvidia-cuda-runtime", "nvidia-nvtx", "nvidia-cufile"}
for key, pkg in pkgs.items():
    if key in on_device:
        continue
    for a in (list(pkg.wheels) or [pkg.sdist]):
        dest = os.path.join(sys.argv[2], a.filename)
        if not (os.path.exists(dest) and hashlib.sha256(open(dest, "rb").read()).hexdigest() == a.sha256):
            urllib.request.urlretrieve(a.url, dest + ".part")
            got = hashlib.sha256(open(dest + ".part", "rb").read()).hexdigest()
            if got != a.sha256:
                sys.exit(f"{a.filename}: sha256 {got}, the set pins {a.sha256}")
            os.replace(dest + ".part", dest)
print(f"staged the set's files in {sys.argv[2]}")
PY
  ;;
install)
  mkdir -p "$OUT"
  [ -d "$SRC/wheels" ] || bash .stage/stage.sh unpack "$SRC" .stage || exit 1
  staged_requirements > /tmp/req-staged.txt || exit 1
  echo "installing $(wc -l < /tmp/req-staged.txt) packages of $PYLOCK, hashes required"
  rm -rf "$ENV"
  $PY -m pip install -q --no-index --no-deps --no-compile --require-hashes --find-links "$SRC/wheels" \
     --target "$ENV" -r /tmp/req-staged.txt || exit 1
  # the whole set against what this process now sees (staged first, then the image's own)
  PYTHONPATH=$ENV:. CUDNN_HOME=$ENV/nvidia/cudnn $PY -m muse_stack.cli stack selfcheck "$lock" --json "$OUT/install-selfcheck-$lock.json" \
    > "$OUT/install-selfcheck-$lock.txt" 2>&1; tail -25 "$OUT/install-selfcheck-$lock.txt"
  ;;
te)
  archs=$($PY -c "import tomllib,sys; print(';'.join(a.replace('.','') for a in tomllib.load(open(sys.argv[1],'rb'))['components']['transformer_engine']['cuda_archs']))" "containers/locks/$lock.toml")
  $PY - "$PYLOCK" > /tmp/req-te-$lock.txt <<'PY'
import sys
sys.path.insert(0, "muse_stack/stack")
import pylock
_, pkgs = pylock.load(sys.argv[1])
print("\n".join(pylock.requirement_lines(pkgs, only={"transformer-engine-torch"}, sdists={"transformer-engine-torch"})))
PY
  rm -rf "/tmp/te-$lock"; start=$(date +%s)
  # the Dockerfile's step: the sdist from the set, hash-checked, forced to build, for the lock's archs
  PYTHONPATH=$ENV NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS="$archs" MAX_JOBS=${MAX_JOBS:-16} \
    CUDNN_PATH=$ENV/nvidia/cudnn \
    $PY -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir --require-hashes \
      --find-links "$SRC/wheels" --target "/tmp/te-$lock" -r /tmp/req-te-$lock.txt > "/tmp/te-build-$lock.log" 2>&1 \
    || { tail -40 "/tmp/te-build-$lock.log"; echo "TE PyTorch extension did not build for $archs"; exit 1; }
  echo "TE PyTorch extension for NVTE_CUDA_ARCHS=$archs built in $(( $(date +%s) - start )) s"
  ls "/tmp/te-$lock"
  ;;
run)
  mkdir -p "$OUT/$lock" runs
  # this lock's TE extension beside the TE package (TE's loader looks there), the other lock's removed
  find "$ENV" -maxdepth 3 -name 'transformer_engine_torch*' -exec rm -rf {} +
  cp -r "/tmp/te-$lock"/. "$ENV"/
  export PYTHONPATH=$ENV:.
  # TE loads cuDNN from CUDNN_HOME, CUDNN_PATH, CUDA_HOME, /usr/local/cuda before the wheels: point it
  # at the set's cuDNN (this machine's /usr/local/cuda carries another one), as the image does
  export CUDNN_HOME=$ENV/nvidia/cudnn CUDNN_PATH=$ENV/nvidia/cudnn
  # and first on the loader's path: cuDNN 9's libcudnn.so.9 opens its sub-libraries by soname, and
  # this machine's /usr/lib holds an apt cuDNN 9.14 that would supply them (the image purges it)
  export LD_LIBRARY_PATH=$ENV/nvidia/cudnn/lib:$ENV/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  MS="$PY -m muse_stack.cli"
  $MS stack selfcheck "$lock" --json "$OUT/$lock/selfcheck.json" > "$OUT/$lock/selfcheck.txt" 2>&1
  tail -22 "$OUT/$lock/selfcheck.txt"
  rm -rf "runs/replay-$lock"
  timeout ${RUN_TIMEOUT:-300} $MS run slice-1gpu --out "runs/replay-$lock" --no-progress > "$OUT/$lock/run.log" 2>&1
  echo "run exit $?"; tail -4 "$OUT/$lock/run.log"
  for f in results.json metrics.jsonl fingerprint.json recipe.yaml; do cp "runs/replay-$lock/$f" "$OUT/$lock/" 2>/dev/null; done
  timeout ${PARITY_TIMEOUT:-200} $PY -m muse_stack.verify.parity --train-steps 3 --out "$OUT/$lock/parity-tp1.json" \
    > "$OUT/$lock/parity.log" 2>&1; echo "parity exit $?"; tail -3 "$OUT/$lock/parity.log"
  $PY -m pip list --format=json > "$OUT/$lock/pip-list.json" 2>/dev/null
  tar -C "$OUT" -czf "$OUT/replay-$lock.tgz" "$lock" && rm -rf "${OUT:?}/$lock"
  ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
