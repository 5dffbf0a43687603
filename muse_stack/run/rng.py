"""The random state a checkpoint holds, so that a resumed run draws what the uninterrupted run
would have drawn.

:func:`capture_rng` takes every generator a training step may draw from in this process: Python's
``random``, NumPy's global generator, torch's CPU generator and, on a GPU, torch's CUDA generator
of each device this process drives (one per rank; each rank's state is saved). An engine with
generators of its own adds them (``extra``: the megatron engine's megatron-core tensor-parallel RNG
tracker, through its ``rng_state`` / ``load_rng_state``). Everything is held as tensors, ints,
floats, strings, lists and dicts, so ``torch.load(weights_only=True)`` reads it back.

:func:`restore_rng` sets them all again. :class:`RandomState` is the run's component for them
(``state_dict`` / ``load_state_dict``, saved per rank by the checkpoint manager): it restores a
loaded state just before the first resumed step, not at load time, so that nothing the run does
between loading and training (setting up its loggers, measuring a peak) moves a generator the
training draws from.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

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


class RandomState:
    """Every generator of this rank, as a component of the run's checkpoints.

    ``state_dict`` captures them (with the engine's own, when it has any); ``load_state_dict``
    keeps a saved state until :meth:`restore_pending`, which the step calls before it draws
    anything. A checkpoint written before checkpoints held every generator holds torch's CPU
    state alone: that is set at once, as such checkpoints were always read."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pending: dict[str, Any] | None = None

    def _extra(self) -> dict[str, Any] | None:
        extra = getattr(self.engine, "rng_state", None)
        return extra() if extra is not None else None

    def state_dict(self) -> dict[str, Any]:
        return capture_rng(self.engine.device, extra=self._extra())

    def load_state_dict(self, state: Any) -> None:
        if torch.is_tensor(state):  # torch's CPU state alone (an older checkpoint)
            torch.set_rng_state(state)
        else:
            self._pending = state

    def restore(self, state: dict[str, Any]) -> None:
        restore_rng(state, self.engine.device)
        load_extra = getattr(self.engine, "load_rng_state", None)
        if load_extra is not None:
            load_extra(state)

    def restore_pending(self) -> None:
        """A resumed run: the generators as they stood after the saved step (once)."""
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.restore(state)

    @contextmanager
    def preserved(self) -> Iterator[None]:
        """Every generator as it was before the block, afterwards (validation draws nothing the
        training would have drawn)."""
        state = self.state_dict()
        try:
            yield
        finally:
            self.restore(state)
