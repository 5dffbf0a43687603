"""Load Hugging Face-named weights (a checkpoint directory) into this rank's
megatron-core Muse Spark model, through the one-to-one mapping of :mod:`.weights`.

Each rank reads only its part, once: a stacked expert tensor is read one local expert at a
time (``safe_open(...).get_slice(name)[expert]``), and a TP / ETP shard as the rows or
columns it keeps (the GLU's gate and up halves as two row ranges), never the whole tensor.
:attr:`Slices.bytes_read` counts what was read.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any

import torch

from muse_stack.engines.mcore.weights import Target, local_to_global, mcore_to_hf
from muse_stack.util.errors import InputError

Index = tuple[Any, ...]


class Slices(abc.ABC):
    """Part-reads of named tensors, with a count of the bytes read (a checkpoint's:
    :class:`CheckpointSlices`)."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.reads = 0

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape."""

    @abc.abstractmethod
    def _read(self, name: str, index: Index) -> torch.Tensor:
        """The part ``index`` of the tensor, read alone."""

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        t = self._read(name, index)
        self.bytes_read += t.numel() * t.element_size()
        self.reads += 1
        return t


class CheckpointSlices(Slices):
    """An HF-style safetensors checkpoint (single file or index), opened lazily per file."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        super().__init__()
        self._open = safe_open
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] | None = json.loads(index.read_text())["weight_map"]
        elif (self.directory / "model.safetensors").is_file():
            self.weight_map = None
        else:
            raise InputError("no safetensors checkpoint found", field="pretrained_checkpoint",
                             value=str(self.directory),
                             fix="point it at a directory holding model.safetensors or model.safetensors.index.json")
        self._handles: dict[str, Any] = {}

    def _slice(self, name: str):
        file = self.weight_map.get(name) if self.weight_map is not None else "model.safetensors"
        if file is None:
            raise KeyError(name)
        if file not in self._handles:
            self._handles[file] = self._open(str(self.directory / file), framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _read(self, name: str, index: Index) -> torch.Tensor:
        sl = self._slice(name)
        return sl[index] if index else sl[:]


def checkpoint_getter(directory: str | Path) -> CheckpointSlices:
    return CheckpointSlices(directory)


def read_part(source: Slices, target: Target, tp_rank: int, tp_size: int, etp_rank: int, etp_size: int
              ) -> torch.Tensor:
    """This rank's part of one checkpoint tensor (the same values as :func:`.weights.shard` of
    the whole tensor), reading only that part."""
    lead: Index = (target.expert,) if target.expert is not None else ()
    axis, rank, size = (target.tp_axis, tp_rank, tp_size) if target.etp_axis is None \
        else (target.etp_axis, etp_rank, etp_size)
    if axis is None or size == 1:
        return source.read(target.hf_name, lead)
    shape = source.shape(target.hf_name)[len(lead):]
    dim = len(lead) + axis  # the axis in the stored tensor

    def rows(start: int, stop: int) -> torch.Tensor:
        index = [slice(None)] * (len(lead) + len(shape))
        if lead:
            index[0] = target.expert
        index[dim] = slice(start, stop)
        return source.read(target.hf_name, tuple(index))

    if target.glu:
        half = shape[axis] // 2
        if half % size:
            raise ValueError(f"{target.hf_name}: GLU halves of {half} do not split over {size} ranks")
        step = half // size
        return torch.cat([rows(rank * step, (rank + 1) * step), rows(half + rank * step, half + (rank + 1) * step)],
                         dim=axis)
    if shape[axis] % size:
        raise ValueError(f"{target.hf_name}: dimension {axis} of size {shape[axis]} does not split over {size} ranks")
    step = shape[axis] // size
    return rows(rank * step, (rank + 1) * step)


def read_rank_weights(source: Slices, local_names: list[str], *, layer_offset: int, expert_offset: int,
                      tp_rank: int, tp_size: int, etp_rank: int, etp_size: int):
    """(local name, tensor) for each of a rank's parameters, each read once and only its part."""
    for name in local_names:
        target = mcore_to_hf(local_to_global(name, layer_offset, expert_offset))
        yield name, target, read_part(source, target, tp_rank, tp_size, etp_rank, etp_size)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, source: Slices, *, layer_offset: int, expert_offset: int, tp_rank: int,
                    tp_size: int, etp_rank: int, etp_size: int) -> int:
    """Copy every parameter and the router's expert bias from the checkpoint; returns the count."""
    loaded = 0
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")})
    for name, target, part in read_rank_weights(source, list(tensors), layer_offset=layer_offset,
                                                expert_offset=expert_offset, tp_rank=tp_rank, tp_size=tp_size,
                                                etp_rank=etp_rank, etp_size=etp_size):
        dest = tensors[name]
        if tuple(part.shape) != tuple(dest.shape):
            raise ValueError(f"{name} <- {target.hf_name}: shape {tuple(part.shape)} does not fit {tuple(dest.shape)}")
        dest.copy_(part.to(device=dest.device, dtype=dest.dtype))
        loaded += 1
    return loaded
