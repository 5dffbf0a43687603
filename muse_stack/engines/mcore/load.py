"""Load Hugging Face-named weights (a checkpoint directory or a state dict) into this rank's
megatron-core Muse Spark model, through the one-to-one mapping of :mod:`.weights`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from muse_stack.engines.mcore.weights import local_to_global, mcore_to_hf, shard
from muse_stack.errors import InputError

Getter = Callable[[str], torch.Tensor]


def checkpoint_getter(directory: str | Path) -> Getter:
    """Lazy tensor reads from an HF-style safetensors checkpoint (single file or index)."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        weight_map = None
    else:
        raise InputError("no safetensors checkpoint found", field="pretrained_checkpoint", value=str(directory),
                         fix="point it at a directory holding model.safetensors or model.safetensors.index.json")
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        file = weight_map.get(name) if weight_map is not None else "model.safetensors"
        if file is None:
            raise KeyError(name)
        if file not in handles:
            handles[file] = safe_open(str(directory / file), framework="pt")
        return handles[file].get_tensor(name)  # type: ignore[attr-defined]

    return get


def state_dict_getter(state: Mapping[str, torch.Tensor]) -> Getter:
    return lambda name: state[name]


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, get: Getter, *, layer_offset: int, expert_offset: int, tp_rank: int,
                    tp_size: int, etp_rank: int, etp_size: int) -> int:
    """Copy every parameter and the router's expert bias from the checkpoint; returns the count."""
    loaded = 0
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
    for name, dest in tensors.items():
        target = mcore_to_hf(local_to_global(name, layer_offset, expert_offset))
        full = get(target.hf_name)
        if target.expert is not None:
            full = full[target.expert]
        part = shard(full, target, tp_rank, tp_size, etp_rank, etp_size)
        if tuple(part.shape) != tuple(dest.shape):
            raise ValueError(f"{name} <- {target.hf_name}: shape {tuple(part.shape)} does not fit {tuple(dest.shape)}")
        dest.copy_(part.to(device=dest.device, dtype=dest.dtype))
        loaded += 1
    return loaded
