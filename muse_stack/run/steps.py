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

from concurrent.futures import Future, ThreadPoolExecutor
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
    state is the stream's position (the epoch and the rows of its order consumed by all ranks).

    While a step runs, one background thread makes the next step's micro-batches (an image-text row's
    images are decoded, resized and cut into patches there: tens of ms a micro-batch, which the GPU would
    otherwise wait for between two steps), as a DataLoader's worker prefetches. The batches and their order
    are the stream's, so training is the same; the position a checkpoint records is that of the batches
    handed out, not of the ones made ahead, and a seek first drops what was made ahead. ``prefetch=False``
    makes each step's batches when it asks for them."""

    #: the same on every rank: a rank the checkpoint has no file for takes rank 0's
    shared = True

    def __init__(self, data: Any, recipe: Recipe, *, rank: int, world_size: int, micro_batches: int,
                 prefetch: bool = True) -> None:
        self.micro_batches = micro_batches
        self.stream = data.batches(recipe.batch.mbs, seed=recipe.training.data_seed, rank=rank,
                                   world_size=world_size, epochs=None)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muse-batches") if prefetch else None
        self._ahead: Future | None = None  #: the next step's batches and the position after them, being made
        self._position = self.stream.position()  #: the position after the batches handed out

    def _make(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return [next(self.stream) for _ in range(self.micro_batches)], self.stream.position()

    def next_step(self, more: bool = True) -> list[dict[str, Any]]:
        """The micro-batches of one optimizer step (an error making them is raised here, for this step);
        ``more``: another step follows, whose batches are made ahead."""
        ahead, self._ahead = self._ahead, None
        batches, self._position = ahead.result() if ahead is not None else self._make()
        if self._pool is not None and more:
            self._ahead = self._pool.submit(self._make)
        return batches

    def _drop_ahead(self) -> None:
        """Wait for the batches being made ahead and put the stream back where the handed-out ones end."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.exception()  # made or failed: either way the stream goes back, and a failure recurs in its step
            self.stream.seek(self._position)

    def close(self) -> None:
        """Stop making batches ahead (the stream stays at the handed-out position)."""
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self._position)

    def load_state_dict(self, position: dict[str, Any]) -> None:
        self._drop_ahead()
        self.stream.seek(position)
        self._position = self.stream.position()

    def no_state(self, step: int) -> None:
        """A checkpoint written before checkpoints held the data position: skip what the finished
        steps consumed."""
        self._drop_ahead()
        for _ in range(step * self.micro_batches):
            next(self.stream)
        self._position = self.stream.position()


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
        return self.engine.train_step(self.data.next_step(more=step < self.total_steps))

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
