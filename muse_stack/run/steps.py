"""What the trainer does around each engine step: the learning rate, the micro-batches and the
random state.

The engine only runs forward, backward and the optimizer step over the micro-batches it is given
(:meth:`muse_stack.engines.Engine.train_step`). :class:`TrainSteps` owns the rest, for the
runner and for any harness that drives an engine step by step:

* the LR of each step (:func:`muse_stack.run.schedule.lr_at`), set on the engine's optimizer
  through ``engine.set_lr``;
* the micro-batch count, GBS / (MBS x DP) with DP the engine's data-parallel size
  (:func:`micro_batches`), and this rank's stream of micro-batches (:class:`TrainData`);
* the random generators (:class:`muse_stack.run.rng.RandomState`), restored before the first
  resumed step and kept unmoved by validation.

The data position and the random state are the run's checkpoint components
(:meth:`TrainSteps.states`): ``state_dict`` / ``load_state_dict``, written per rank by
:class:`muse_stack.run.checkpoints.CheckpointManager` whatever the engine.
"""

from __future__ import annotations

from typing import Any, Iterator

from muse_stack.engines.base import StepStats
from muse_stack.recipes.schema import Recipe
from muse_stack.run.rng import RandomState
from muse_stack.run.schedule import lr_at
from muse_stack.util.errors import RecipeError


def micro_batches(recipe: Recipe, dp_size: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank, by the one GBS / (MBS x DP)
    rule (:func:`muse_stack.recipes.layout.micro_batches`); a global batch that does not split so is
    refused, naming the field."""
    from muse_stack.recipes.layout import micro_batches as rule

    batch = recipe.batch
    if not batch.mbs or not batch.gbs:
        raise RecipeError("the run needs the micro- and global batch sizes",
                          field="batch.mbs" if not batch.mbs else "batch.gbs", value=None,
                          fix="set batch.mbs and batch.gbs")
    return rule(batch.gbs, batch.mbs, dp_size, strict=True)


class TrainData:
    """This data-parallel rank's stream of training micro-batches, as a checkpoint component: its
    state is the stream's position (the epoch and the rows of its order consumed by all ranks)."""

    #: the same on every rank: a rank the checkpoint has no file for takes rank 0's
    shared = True

    def __init__(self, data: Any, recipe: Recipe, *, rank: int, world_size: int, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self.stream = data.batches(recipe.batch.mbs, seed=recipe.training.data_seed, rank=rank,
                                   world_size=world_size, epochs=None)

    def next_step(self) -> list[dict[str, Any]]:
        """The micro-batches of one optimizer step."""
        return [next(self.stream) for _ in range(self.micro_batches)]

    def state_dict(self) -> dict[str, Any]:
        return self.stream.position()

    def load_state_dict(self, position: dict[str, Any]) -> None:
        self.stream.seek(position)

    def no_state(self, step: int) -> None:
        """A checkpoint written before checkpoints held the data position: skip what the finished
        steps consumed."""
        for _ in range(step * self.micro_batches):
            next(self.stream)


class TrainSteps:
    """The state of the run's steps around one engine (see the module doc). ``step(n)`` runs
    optimizer step ``n`` (1-based) of ``total_steps``."""

    def __init__(self, engine: Any, recipe: Recipe, data: Any, total_steps: int) -> None:
        self.engine, self.recipe, self.total_steps = engine, recipe, total_steps
        #: the engine's data-parallel rank and size: the rows this process reads
        rank, size = engine.data_parallel()
        self.micro_batches = micro_batches(recipe, size)
        self.data = TrainData(data, recipe, rank=rank, world_size=size, micro_batches=self.micro_batches)
        self.rng = RandomState(engine)
        self.lr: float | None = None  #: the LR of the last step run

    def states(self) -> dict[str, Any]:
        """The components a checkpoint holds for each rank, by name (the names are the keys of the
        per-rank state files)."""
        return {"rng": self.rng, "data": self.data}

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.recipe.optimizer, self.total_steps)

    def step(self, step: int) -> StepStats:
        self.rng.restore_pending()
        self.lr = self.lr_at(step)
        self.engine.set_lr(self.lr)
        return self.engine.train_step(self.data.next_step())

    def evaluate(self, held: Any) -> tuple[float, int]:
        """The loss over the held-out split (:class:`muse_stack.data.split.HeldOut`): its
        ``eval_iters`` global batches, each split over the data-parallel ranks and micro-batches
        as a step is, with every generator as it was afterwards."""
        rank, size = self.engine.data_parallel()
        with self.rng.preserved():
            stream = held.batches(self.recipe.batch.mbs, rank=rank, world_size=size)
            return self.engine.evaluate(self._global_batches(stream, held.eval_iters))

    def _global_batches(self, stream: Iterator[dict[str, Any]], count: int) -> Iterator[list[dict[str, Any]]]:
        for _ in range(count):
            yield [next(stream) for _ in range(self.micro_batches)]
