#!/bin/sh
# Entry point of the muse-stack image: `docker run IMAGE run sft-192` runs `muse-stack run sft-192`.
#
# Host driver: the NVIDIA container toolkit (and enroot/pyxis) inject libcuda.so.1 from the host
# driver somewhere in the container (/usr/lib/<arch>-linux-gnu, /usr/local/nvidia/lib64, ...).
# Nix-built binaries look for it in /run/opengl-driver/lib only. If that path lacks it, link the
# injected driver there when we may; else (uid 1000 cannot create /run/opengl-driver) put the
# driver's folder on LD_LIBRARY_PATH *after* what is there: that folder (/usr/lib/<triplet>) is a
# system folder and must never come before the set's cuDNN and NCCL.
# Only shell builtins, awk and coreutils are used: the Nix image carries nothing else (no sed).
# MUSE_STACK_DRIVER_DIRS and MUSE_STACK_OPENGL_DRIVER override the folders searched and the link's
# place (for tests).
set -eu

driver_dirs="${MUSE_STACK_DRIVER_DIRS:-/usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib64 /usr/lib /usr/local/cuda/compat/lib}"
opengl="${MUSE_STACK_OPENGL_DRIVER:-/run/opengl-driver}"

find_libcuda() {
  if [ -z "${MUSE_STACK_DRIVER_DIRS:-}" ] && command -v ldconfig >/dev/null 2>&1; then
    p=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
    if [ -n "$p" ] && [ -e "$p" ]; then echo "$p"; return 0; fi
  fi
  for d in $driver_dirs; do
    if [ -e "$d/libcuda.so.1" ]; then echo "$d/libcuda.so.1"; return 0; fi
  done
  return 1
}

if [ ! -e "$opengl/lib/libcuda.so.1" ] && lib=$(find_libcuda); then
  dir=$(dirname "$lib")
  if mkdir -p "$opengl" 2>/dev/null && ln -sfn "$dir" "$opengl/lib" 2>/dev/null; then
    :
  else
    case ":${LD_LIBRARY_PATH:-}:" in
      *":$dir:"*) ;;
      *) export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$dir" ;;
    esac
  fi
fi

# Results: `muse-stack run` writes under ./runs, which is /workspace/runs, a VOLUME of the image. Say
# where they will be before the run starts: a folder not mounted at all is lost with the container,
# an anonymous volume is kept but hard to find, and a host folder is named as the host sees it
# (field 4 of /proc/self/mountinfo: the mount's root within its source filesystem).
runs_notice() {
  runs="${MUSE_STACK_RUNS_DIR:-/workspace/runs}"
  info="${MUSE_STACK_MOUNTINFO:-/proc/self/mountinfo}"
  [ -r "$info" ] || return 0
  line=$(awk -v d="$runs" '$5 == d { r = $4; for (i = 7; i <= NF; i++) if ($i == "-") { s = $(i + 2) } }
                           END { if (r != "") { gsub(/\\040/, " ", r); gsub(/\\040/, " ", s); print r "\t" s } }' "$info")
  root=${line%%"$(printf '\t')"*}
  src=${line#*"$(printf '\t')"}
  case "$root" in
    "")
      echo "muse-stack: warning: $runs is not a mounted folder: the run's results are lost when this container" \
           "is removed; mount a host folder: docker run -v \"\$PWD/runs:$runs\" ..." >&2 ;;
    */volumes/*/_data)
      vol=$(basename "$(dirname "$root")")
      if printf '%s' "$vol" | grep -Eq '^[0-9a-f]{64}$'; then
        echo "muse-stack: warning: $runs is an anonymous volume ($vol): the results outlive the container" \
             "but only \`docker volume ls\` finds them; mount a host folder: docker run -v \"\$PWD/runs:$runs\" ..." >&2
      else
        echo "muse-stack: results go to $runs, volume $vol on the host" >&2
      fi ;;
    *)
      echo "muse-stack: results go to $runs, mounted from the host's $root (on $src)" >&2 ;;
  esac
}

# `docker run IMAGE bash` (or any other program) runs that program; everything else is muse-stack,
# with or without a leading `muse-stack` (launchers such as pyxis may or may not run the entrypoint)
case "${1:-}" in
  bash|sh|python|python3|/*) exec "$@" ;;
  muse-stack) shift ;;
esac
# a run that writes to the default runs folder (no --out, no --resume elsewhere)
if [ "${1:-}" = run ]; then
  case " $* " in
    *" --out "*|*" --out="*|*" --resume "*|*" --resume="*) ;;
    *) runs_notice ;;
  esac
fi
exec muse-stack "$@"
