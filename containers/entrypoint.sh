#!/bin/sh
# Entry point of the muse-stack image: `docker run IMAGE run sft-192` runs `muse-stack run sft-192`.
#
# Host driver: the NVIDIA container toolkit (and enroot/pyxis) inject libcuda.so.1 from the host
# driver somewhere in the container (/usr/lib/<arch>-linux-gnu, /usr/local/nvidia/lib64, ...).
# Nix-built binaries look for it in /run/opengl-driver/lib only. If that path lacks it, link the
# injected driver there when we may, else put the driver's directory on LD_LIBRARY_PATH.
set -eu

find_libcuda() {
  if command -v ldconfig >/dev/null 2>&1; then
    p=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
    if [ -n "$p" ] && [ -e "$p" ]; then echo "$p"; return 0; fi
  fi
  for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/local/nvidia/lib64 \
           /usr/local/nvidia/lib /usr/lib64 /usr/lib /usr/local/cuda/compat/lib; do
    if [ -e "$d/libcuda.so.1" ]; then echo "$d/libcuda.so.1"; return 0; fi
  done
  return 1
}

if [ ! -e /run/opengl-driver/lib/libcuda.so.1 ] && lib=$(find_libcuda); then
  dir=$(dirname "$lib")
  if mkdir -p /run/opengl-driver 2>/dev/null && ln -sfn "$dir" /run/opengl-driver/lib 2>/dev/null; then
    :
  else
    export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi

# `docker run IMAGE bash` (or any other program) runs that program; everything else is muse-stack,
# with or without a leading `muse-stack` (launchers such as pyxis may or may not run the entrypoint)
case "${1:-}" in
  bash|sh|python|python3|/*) exec "$@" ;;
  muse-stack) shift ;;
esac
exec muse-stack "$@"
