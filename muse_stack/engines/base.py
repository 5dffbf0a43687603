"""What an engine does for the run pipeline: one optimizer step at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from muse_stack.model_config import ModelConfig
from muse_stack.recipes.schema import Recipe


@dataclass
class TrainContext:
    recipe: Recipe
    model: ModelConfig
    data: Any  # muse_stack.data.BuiltData
    total_steps: int
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    pretrained_checkpoint: str | None = None


@dataclass
class StepStats:
    loss: float  #: mean over the step's supervised tokens, all ranks
    grad_norm: float
    lr: float
    tokens: int  #: tokens processed in the step, all ranks (padding included)
    supervised_tokens: int


class Engine(Protocol):
    name: str
    device: str

    def __init__(self, ctx: TrainContext) -> None: ...

    def train_step(self, step: int) -> StepStats: ...

    def seq_lens(self) -> list[int]:
        """Sequence lengths of a typical micro-batch row, for the attention FLOP count."""
        ...

    def peak_memory_gib(self) -> float | None: ...

    def save(self, directory: Path, step: int) -> None:
        """Write this engine's state (weights, optimizer, RNG) into ``directory``, an empty folder
        the run's checkpoint manager made; it adds trainer_state.json and completes the folder.
        An engine that only starts the write may also define ``finalize_save(blocking) -> bool``
        (True once no save is in flight), called by every rank at the same points."""
        ...

    def load(self, directory: Path) -> int:
        """Read the state a ``save`` wrote and position the data after it; returns the step
        (``trainer_state.json``)."""
        ...

    def describe(self) -> dict[str, Any]: ...
