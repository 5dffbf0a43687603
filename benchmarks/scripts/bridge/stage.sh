#!/usr/bin/env bash
# Megatron-Bridge 0.6.2 for a GPU machine with no package registry: the wheels its pretrain path
# imports and the H200 image lacks (wheels.txt; the image has torch 2.11, numpy, pyarrow, pandas,
# huggingface-hub, tensorboard, ...; TE 2.20.2 + megatron-core 0.19.2 come from benchmarks/scripts/stage-gpu.sh).
#   here:    bash benchmarks/scripts/bridge/stage.sh download [.whl/bridge]   # ~46 MB, then carry it (one call)
#   device:  bash benchmarks/scripts/bridge/stage.sh install  [DIR]           # into /tmp/site-bridge
#            PYTHONPATH=/tmp/site-bridge:/tmp/site:. python3 benchmarks/scripts/bridge_slice.py slice-1gpu ...
# A target of its own: megatron-bridge and megatron-energon both ship the namespace folder megatron/,
# and pip --target skips (or, with --upgrade, deletes) a top-level folder that exists already, so
# installing into /tmp/site would lose megatron/core; Bridge's transformers / tokenizers pins stay
# out of the engine's path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:-help}; d=${2:-.whl/bridge}
case "$cmd" in
download)
  mkdir -p "$d/deps"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_39_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    -d "$d/deps" -r "$here/wheels.txt"
  mv "$d"/deps/megatron_bridge-*.whl "$d/"
  du -sh "$d" ;;
install)
  T=${TARGET:-/tmp/site-bridge}
  rm -rf "$T"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T" \
    "$d"/megatron_bridge-*.whl "$d"/deps/*.whl
  PYTHONPATH="$T:/tmp/site:${PYTHONPATH:-}" python3 -c "
from megatron.bridge.training.pretrain import pretrain
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.models.gpt_provider import GPTModelProvider
import importlib.metadata as md
print('bridge', md.version('megatron-bridge'), 'megatron-core', md.version('megatron-core'))" ;;
*) sed -n 2,11p "$0"; exit 2 ;;
esac
