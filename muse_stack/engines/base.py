"""What an engine does for the run pipeline: one optimizer step at a time over the micro-batches it
is given. The run owns the rest of the step's state (the LR, the micro-batch count, the data and
its position, the random generators: :mod:`muse_stack.run.steps`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes.schema import Recipe


@dataclass
class TrainContext:
    recipe: Recipe
    model: ModelConfig
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    pretrained_checkpoint: str | None = None
    #: the muse_stack.resolve.recipe.ResolvedRecipe of ``recipe``: the towers, the adapters and the
    #: micro-batches per step the engine builds, as the resolve step derived them
    resolved: Any = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.resolved.recipe is not self.recipe or self.resolved.model != self.model:
            raise ValueError("TrainContext: the resolved recipe is not the recipe and model given")


@dataclass
class StepStats:
    loss: float  #: mean over the step's supervised tokens, all ranks
    grad_norm: float
    tokens: int  #: tokens processed in the step, all ranks (padding included)
    supervised_tokens: int


class Engine(Protocol):
    """One optimizer step at a time over the micro-batches it is given. Optional: an engine with
    random generators of its own (beside Python's, NumPy's and torch's) exposes them as
    ``rng_state() -> dict`` and ``load_rng_state(state)``, for the run's random state
    (:mod:`muse_stack.run.rng`) to save, restore and keep unmoved around validation."""

    name: str
    device: str

    def __init__(self, ctx: TrainContext) -> None: ...

    def data_parallel(self) -> tuple[int, int]:
        """This process's data-parallel rank and the data-parallel size: which share of each
        global batch it reads (the run splits GBS into GBS / (MBS x DP) micro-batches a rank)."""
        ...

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer step (the run's schedule decides it)."""
        ...

    def train_step(self, micro_batches: list[dict[str, Any]]) -> StepStats:
        """Forward and backward over this rank's micro-batches of one step, then the optimizer step."""
        ...

    def evaluate(self, batches: Iterable[list[dict[str, Any]]]) -> tuple[float, int]:
        """The model's loss over the held-out global batches given (this rank's micro-batches of
        each): the mean over their supervised tokens, all ranks, no update, and the number of
        those tokens; every rank calls it at the same steps and gets the same values. The run
        keeps every random generator as it was."""
        ...

    def seq_lens(self) -> list[int]:
        """Sequence lengths of a typical micro-batch row, for the attention FLOP count."""
        ...

    def peak_memory_gib(self) -> float | None: ...

    def save(self, directory: Path, step: int) -> None:
        """Write this engine's state (weights, optimizer) into ``directory``, a folder the run's
        checkpoint manager made; it adds the run's own state (trainer_state.json, each rank's random
        generators and data position) and completes the folder.
        An engine that only starts the write may also define ``finalize_save(blocking) -> bool``
        (True once no save is in flight), called by every rank at the same points."""
        ...

    def checkpoint_bytes(self) -> int:
        """About how many bytes one ``save`` of the whole run writes (every rank's share, each
        tensor once), for the free-space check before checkpoints; called on every rank."""
        ...

    def load(self, directory: Path) -> None:
        """Read the state a ``save`` wrote (the run reads its own)."""
        ...

    def describe(self) -> dict[str, Any]: ...


def corrupt_checkpoint(directory: Path, what: str, exc: BaseException):
    """The InputError for a checkpoint file that cannot be loaded."""
    from muse_stack.util.errors import InputError
    from muse_stack.util.safeio import short_repr

    return InputError(f"the checkpoint's {what} cannot be loaded ({type(exc).__name__}: {short_repr(str(exc))})",
                      field="--resume", value=str(directory),
                      fix="the checkpoint is truncated or corrupt; start a new run (the run directory keeps its metrics)")
