"""What an engine does for the run pipeline: one optimizer step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from muse_stack.models.muse_spark.config import ModelConfig
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
    validation: Any = None  # muse_stack.data.split.HeldOut: the held-out rows (None: no validation)
    #: the muse_stack.recipes.resolve.ResolvedRecipe of ``recipe``: the towers, the adapters and the
    #: micro-batches per step the engine builds, as the resolve step derived them
    resolved: Any = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.resolved.recipe is not self.recipe or self.resolved.model != self.model:
            raise ValueError("TrainContext: the resolved recipe is not the recipe and model given")


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

    def evaluate(self) -> tuple[float, int]:
        """The model's loss over the held-out split (``ctx.validation``): the mean over the
        supervised tokens of its ``eval_iters`` global batches, all ranks, no update, and the
        number of those tokens; every rank calls it at the same steps and gets the same values."""
        ...

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

    def checkpoint_bytes(self) -> int:
        """About how many bytes one ``save`` of the whole run writes (every rank's share, each
        tensor once), for the free-space check before checkpoints; called on every rank."""
        ...

    def load(self, directory: Path) -> int:
        """Read the state a ``save`` wrote and position the data after it; returns the step
        (``trainer_state.json``)."""
        ...

    def describe(self) -> dict[str, Any]: ...


def checkpoint_step(directory: Path, total_steps: int) -> int:
    """The step a run checkpoint was saved after, from its trainer_state.json; a missing, truncated
    or out-of-range state is an InputError, never a traceback or a loop over a bogus count."""
    from muse_stack.util.errors import InputError
    from muse_stack.util.safeio import read_json

    fix = "the checkpoint is truncated or corrupt; start a new run (the run directory keeps its metrics)"
    state = read_json(Path(directory) / "trainer_state.json", field="--resume", what="trainer state", fix=fix)
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= total_steps:
        raise InputError(f"trainer_state.json holds step {step!r}, not a step of this run (0-{total_steps})",
                         field="--resume", value=str(directory), fix=fix)
    return step


def corrupt_checkpoint(directory: Path, what: str, exc: BaseException):
    """The InputError for a checkpoint file that cannot be loaded."""
    from muse_stack.util.errors import InputError
    from muse_stack.util.safeio import short_repr

    return InputError(f"the checkpoint's {what} cannot be loaded ({type(exc).__name__}: {short_repr(str(exc))})",
                      field="--resume", value=str(directory),
                      fix="the checkpoint is truncated or corrupt; start a new run (the run directory keeps its metrics)")
