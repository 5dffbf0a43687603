#!/usr/bin/env bash
# Stage what a GPU run of benchmarks/ needs onto a GPU machine that reaches no package registry and takes
# at most 64 MiB of files per call (the folder a call carries must be git-ignored: `.stage/` is).
#
# Any folder (a wheel set, a dataset, a checkpoint) travels as numbered chunks of a tar stream, at most
# $CHUNK (46m) each, one chunk per call, with a manifest of their sha256. `unpack` checks every chunk
# against the manifest before it extracts, so a missed or torn chunk is named, not half-installed.
# Received chunks wait in /tmp/stage-chunks/NAME (STAGE_CHUNKS), which lasts while the machine stays warm: make
# the calls back to back.
#
# Transformer Engine and megatron-core (the stack most of benchmarks/results/ ran on: TE $TE_VERSION with
# its PyTorch extension built on the GPU machine for sm_$NVTE_CUDA_ARCHS, megatron-core $MCORE_VERSION,
# on the machine's own python 3.12 and torch) are one such folder and an install step. From the
# repository root:
#   here:    bash benchmarks/scripts/stage-gpu.sh te-download [.stage/te-src]   # ~300 MB: the wheels and TE's torch sdist
#            bash benchmarks/scripts/stage-gpu.sh pack .stage/te-src [.stage/te] # chunks; prints the device calls
#   device:  bash benchmarks/scripts/stage-gpu.sh receive K [.stage/te]          # one call per chunk, carry [".stage/te/cK"]
#            bash benchmarks/scripts/stage-gpu.sh te-install [.stage/te]         # carry [".stage/te/manifest"]
#   then, in every later call on that machine: PYTHONPATH=/tmp/site (benchmarks/scripts/h200.sh sets it)
# Any other folder:
#   here:    bash benchmarks/scripts/stage-gpu.sh pack SRC [DIR]
#   device:  bash benchmarks/scripts/stage-gpu.sh receive K [DIR]     (one call per chunk)
#            bash benchmarks/scripts/stage-gpu.sh unpack DEST [DIR]   (carry [DIR/manifest])
# te-install takes about 4 minutes of the GPU machine, most of it building TE's extension (~105 s on
# 16 cores with MAX_JOBS=16).
set -euo pipefail
cmd=${1:-help}
CHUNK=${CHUNK:-46m}
TE_VERSION=${TE_VERSION:-2.20.2}
MCORE_VERSION=${MCORE_VERSION:-0.19.2}
NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90}
SITE=${SITE:-/tmp/site}

die() { echo "stage-gpu.sh: $*" >&2; exit 1; }
chunks_of() { echo "${STAGE_CHUNKS:-/tmp/stage-chunks}/$(basename "$1")"; }  # where `receive` keeps DIR's chunks

unpack() { # DEST DIR: every chunk of DIR's manifest present and intact, then the tar stream extracted into DEST
  local dest=$1 d=$2 have
  [ -f "$d/manifest" ] || die "no $d/manifest: carry it in this call (pack writes it)"
  have=$(chunks_of "$d")
  [ -d "$have" ] || die "no chunks received into $have: run 'receive K $d' for each chunk first, back to back"
  (cd "$have" && sha256sum -c --quiet -) < "$d/manifest" || die "chunks missing or torn in $have (see above): receive them again"
  mkdir -p "$dest"
  cat "$have"/part.* | tar -C "$dest" -xf -
  echo "unpacked $(du -sh "$dest" | cut -f1) into $dest"
}

case "$cmd" in
pack)
  src=${2:?usage: stage-gpu.sh pack SRC [DIR]}; d=${3:-.stage/$(basename "$src")-stage}
  [ -d "$src" ] || die "no folder $src"
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1 && ! git check-ignore -q "$d"; then
    die "$d is not git-ignored: every device call would carry it (use a folder under .stage/)"
  fi
  rm -rf "$d" && mkdir -p "$d/tmp"
  tar -C "$src" -cf - . | split -b "$CHUNK" -d -a 3 - "$d/tmp/part."
  n=0; : > "$d/manifest"
  for f in "$d"/tmp/part.*; do
    mkdir -p "$d/c$n" && mv "$f" "$d/c$n/"
    (cd "$d/c$n" && sha256sum part.*) >> "$d/manifest"
    n=$((n + 1))
  done
  rmdir "$d/tmp"
  echo "packed $(du -sh "$src" | cut -f1) of $src into $n chunks in $d; the device calls, back to back:"
  for ((k = 0; k < n; k++)); do
    echo "  run: bash benchmarks/scripts/stage-gpu.sh receive $k $d      carry: [\"$d/c$k\"]"
  done
  echo "  then: bash benchmarks/scripts/stage-gpu.sh unpack DEST $d (or te-install $d)   carry: [\"$d/manifest\"]"
  ;;
receive)
  k=${2:?usage: stage-gpu.sh receive K [DIR]}; d=${3:-.stage/te}
  [ -d "$d/c$k" ] || die "no $d/c$k here: carry it in this call"
  have=$(chunks_of "$d")
  mkdir -p "$have" && cp "$d/c$k"/part.* "$have/"
  echo "have $(ls "$have" | wc -l) of $(wc -l < "$d/manifest" 2>/dev/null || echo '?') chunk(s) in $have"
  ;;
unpack)
  unpack "${2:?usage: stage-gpu.sh unpack DEST [DIR]}" "${3:-.stage/te}"
  ;;
te-download)
  d=${2:-.stage/te-src}
  mkdir -p "$d"
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$d" \
    "transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION" "megatron-core==$MCORE_VERSION" \
    pydantic pydantic-core annotated-types typing-inspection importlib-metadata nvdlfw-inspect "nvidia-cudnn-frontend>=1.29"
  # TE's PyTorch extension ships as a source archive, built on the GPU machine against its torch. pip would build
  # its metadata here, which needs a CUDA torch; the archive is fetched as the index lists it, its sha256 checked
  python3 - "$d" "$TE_VERSION" "${INDEX_URL:-https://pypi.org/simple}" <<'PY' || die "TE's torch source archive did not download (above)"
import hashlib, json, sys, urllib.request
dest, version, index = sys.argv[1], sys.argv[2], sys.argv[3].rstrip("/")
page = urllib.request.Request(f"{index}/transformer-engine-torch/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(page, timeout=60) as r:
    files = [f for f in json.load(r)["files"] if f["filename"] == f"transformer_engine_torch-{version}.tar.gz"]
if len(files) != 1:
    sys.exit(f"{index}/transformer-engine-torch/ lists no source archive of version {version}")
f = files[0]
with urllib.request.urlopen(f["url"], timeout=300) as r:
    body = r.read()
if hashlib.sha256(body).hexdigest() != f["hashes"]["sha256"]:
    sys.exit(f"{f['filename']}: its sha256 differs from the one the index lists")
with open(f"{dest}/{f['filename']}", "wb") as out:
    out.write(body)
PY
  echo "downloaded $(ls "$d" | wc -l) files, $(du -sh "$d" | cut -f1), into $d; next: $0 pack $d .stage/te"
  ;;
te-install)
  d=${2:-.stage/te}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  w=/tmp/stage-te
  rm -rf "$w" && unpack "$w" "$d"
  ls "$w"/transformer_engine_cu13-*.whl "$w"/megatron_core-*.whl "$w"/transformer_engine_torch-*.tar.gz > /dev/null \
    || die "$d does not hold TE's core wheel, megatron-core and TE's torch sdist: te-download and pack again"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$w"/*.whl
  build=/tmp/stage-te-build
  rm -rf "$build" && mkdir -p "$build" && tar xzf "$w"/transformer_engine_torch-*.tar.gz -C "$build"
  src=$(echo "$build"/transformer_engine_torch-*)
  start=$(date +%s)
  (cd "$src" && PYTHONPATH="$SITE" NVTE_CUDA_ARCHS="$NVTE_CUDA_ARCHS" MAX_JOBS=${MAX_JOBS:-16} NVTE_FRAMEWORK=pytorch \
     python3 -m pip install --no-deps --no-build-isolation --no-cache-dir --target "$build/ext" . > "$build/build.log" 2>&1) || true
  so=$(find "$src" "$build/ext" -name 'transformer_engine_torch*.so' 2>/dev/null | head -1)
  [ -n "$so" ] || { tail -40 "$build/build.log"; die "TE's torch extension did not build (log above)"; }
  cp "$so" "$SITE/transformer_engine/wheel_lib/"
  echo "TE's torch extension built in $(( $(date +%s) - start )) s"
  PYTHONPATH="$SITE" python3 -c "import transformer_engine as te, transformer_engine.pytorch, megatron.core as mc
print('staged Transformer Engine', te.__version__, 'and megatron-core', mc.__version__, 'in $SITE')"
  rm -rf "$(chunks_of "$d")"
  ;;
*)
  sed -n 2,26p "$0"
  [ "$cmd" = help ] || exit 2
  ;;
esac
