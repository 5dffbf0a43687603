"""The random state and data position a checkpoint holds, so that a resumed run draws what the
uninterrupted run would have drawn.

:func:`capture_rng` takes every generator a training step may draw from in this process: Python's
``random``, NumPy's global generator, torch's CPU generator and, on a GPU, torch's CUDA generator
of each device this process drives (one per rank; each rank's state is saved). The megatron engine
adds megatron-core's tensor-parallel RNG tracker (``extra``). Everything is held as tensors, ints,
floats, strings, lists and dicts, so ``torch.load(weights_only=True)`` reads it back.

:func:`restore_rng` sets them all again. The engines restore just before the first resumed step,
not at load time, so that nothing the run does between loading and training (setting up its
loggers, measuring a peak) moves a generator the training draws from.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

#: the layout of a saved state; a checkpoint without it (written before) holds torch's CPU state only
RNG_FORMAT = "muse-stack-rng/1"


def _numpy_state() -> dict[str, Any]:
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {"name": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _set_numpy_state(state: dict[str, Any]) -> None:
    key = state["key"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], key, int(state["pos"]), int(state["has_gauss"]), float(state["gauss"])))


def _python_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _set_python_state(state: dict[str, Any]) -> None:
    internal = tuple(int(v) for v in state["internal"].tolist())
    random.setstate((int(state["version"]), internal, state["gauss"]))


def capture_rng(device: str | torch.device | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every generator of this process a step draws from (see the module doc). ``device``: the
    CUDA device this rank drives (None or a CPU device: no CUDA state)."""
    state: dict[str, Any] = {"format": RNG_FORMAT, "python": _python_state(), "numpy": _numpy_state(),
                             "torch_cpu": torch.get_rng_state()}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        state["torch_cuda"] = {"device": index, "state": torch.cuda.get_rng_state(index)}
    if extra:
        state.update(extra)
    return state


def restore_rng(state: dict[str, Any], device: str | torch.device | None = None) -> None:
    """Set every generator :func:`capture_rng` took; a state saved with CUDA is restored onto this
    rank's device (the device index may differ between machines, the rank's generator does not)."""
    _set_python_state(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    cuda = state.get("torch_cuda")
    dev = torch.device(device) if device is not None else None
    if cuda is not None and dev is not None and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.set_rng_state(cuda["state"], index)


def is_full_state(state: Any) -> bool:
    """Whether a saved RNG entry is a :func:`capture_rng` state (else torch's CPU state alone)."""
    return isinstance(state, dict) and state.get("format") == RNG_FORMAT


#: where each rank's random state and the data position go in a step folder whose engine writes
#: per rank (the megatron engine: every rank writes its shards into the same folder)
RANK_DIR = "rng"


def rank_file(directory, rank: int):
    from pathlib import Path

    return Path(directory) / RANK_DIR / f"rank-{rank:05d}.pt"


def save_rank_state(directory, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state (:func:`capture_rng` and the data position) into the step folder."""
    import io

    from muse_stack.util import atomic

    buf = io.BytesIO()
    torch.save(state, buf)
    atomic.write_bytes(rank_file(directory, rank), buf.getvalue())


def load_rank_state(directory, rank: int) -> dict[str, Any] | None:
    """One rank's saved state; None when the folder has none for this rank (written before
    checkpoints held it, or by fewer ranks). A file that does not load is a corrupt checkpoint."""
    from muse_stack.engines.base import corrupt_checkpoint

    file = rank_file(directory, rank)
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not (isinstance(state, dict) and is_full_state(state.get("rng"))):
            raise TypeError(f"{file.name} holds no random state")
        return state
    except Exception as exc:  # the zip reader's and the unpickler's own errors included
        raise corrupt_checkpoint(file.parent.parent, f"random state and data position ({RANK_DIR}/{file.name})",
                                 exc) from exc
