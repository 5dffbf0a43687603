"""The held-out split of a recipe's rows, for validation (``validation`` in a recipe).

The build's rows stay as built and cached; the split is drawn from them when a run starts:

* ``eval_iters x batch.gbs`` rows are held out: the first that many of
  ``numpy.random.RandomState(HOLD_OUT_SEED).permutation(rows)``, kept in stored order. A fixed
  seed (not the data seed) so that the same build always holds out the same rows, whatever order
  training visits the others in; a permutation rather than the last rows because the packed
  builder places its smallest conversations in its last packs.
* training takes every other row, in stored order, and batches them as it batches a whole build
  (:mod:`muse_stack.data.batches`); their rows sha256 is the fingerprint's ``rows_sha256``, and
  the held-out rows' is recorded beside it.

Each validation loss covers the same held-out rows: ``eval_iters`` global batches in stored
order, split over the data-parallel ranks and micro-batches as a training step is. A recipe
without ``validation`` gets no split: its rows, their hash and their order are unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from muse_stack.data.rows import Rows, rows_sha256
from muse_stack.util.errors import RecipeError

#: the seed of the held-out rows' draw ("val")
HOLD_OUT_SEED = 0x76616C


def subset(rows: Rows, index: np.ndarray) -> Rows:
    """The rows at ``index`` (in that order), with their sequence lengths and images."""
    index = np.asarray(index, dtype=np.int64)
    pick = [int(i) for i in index]
    return Rows(ids=rows.ids[index], mask=rows.mask[index],
                seq_lengths=[rows.seq_lengths[i] for i in pick] if rows.seq_lengths else [],
                seq_lengths_padded=[rows.seq_lengths_padded[i] for i in pick] if rows.seq_lengths_padded else [],
                packed=rows.packed,
                images=[rows.images[i] for i in pick] if rows.images is not None else None,
                image_grids=[rows.image_grids[i] for i in pick] if rows.image_grids is not None else None,
                image_spec=rows.image_spec)


def held_out_index(num_rows: int, count: int) -> np.ndarray:
    """The positions of the ``count`` held-out rows among ``num_rows``, ascending."""
    return np.sort(np.random.RandomState(HOLD_OUT_SEED).permutation(num_rows)[:count])


@dataclasses.dataclass
class HeldOut:
    """The held-out rows and how a validation loss walks them."""

    rows: Rows
    rows_sha256: str
    eval_iters: int
    eval_interval: int
    index: np.ndarray  #: their positions in the build
    pad_id: int = 0

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    def batches(self, micro_batch_size: int, rank: int = 0, world_size: int = 1):
        """The micro-batches of one rank for one validation loss: the held-out rows in stored order,
        ``micro_batch_size`` x ``world_size`` rows per micro-step, rank ``r`` the ``r``-th slice."""
        from muse_stack.data.batches import iterate

        return iterate(self.rows, micro_batch_size, seed=None, rank=rank, world_size=world_size, epochs=1,
                       pad_id=self.pad_id)

    def describe(self) -> dict[str, Any]:
        return {"rows": self.num_rows, "rows_sha256": self.rows_sha256, "eval_iters": self.eval_iters,
                "eval_interval": self.eval_interval, "seed": HOLD_OUT_SEED}


def check_stated(recipe: Any) -> None:
    """A recipe that validates states (or has filled) both keys and a global batch size: checked
    before a run writes anything."""
    validation = recipe.validation
    if validation is None:
        return
    for field in ("eval_interval", "eval_iters"):
        if getattr(validation, field) is None:
            raise RecipeError(f"validation.{field} is unstated and the recipe's fill policy gives none",
                              field=f"validation.{field}", value=None,
                              fix=f"state it (e.g. validation.{field}=100), or set fill_policy: megatron-bridge-0.6.2 "
                                  "on a pretrain, sft or peft recipe")
    if not recipe.batch.gbs:
        raise RecipeError("validation needs the global batch size: the held-out split is eval_iters x batch.gbs "
                          "rows", field="batch.gbs", value=recipe.batch.gbs, fix="set batch.gbs")


def split_for_recipe(recipe: Any, data: Any) -> tuple[Any, HeldOut | None]:
    """``(training data, held-out split)`` for a recipe and its build: the build itself and None
    when the recipe has no ``validation``; else a build of the training rows alone (same folder,
    its own rows sha256) and the held-out rows."""
    validation = recipe.validation
    if validation is None:
        return data, None
    check_stated(recipe)
    gbs = recipe.batch.gbs
    count = validation.eval_iters * gbs
    all_rows = data.rows()
    total = all_rows.num_rows
    if count + gbs > total:
        raise RecipeError(f"validation holds out eval_iters x batch.gbs = {validation.eval_iters} x {gbs} = {count} "
                          f"of the build's {total} rows, leaving {total - count}, less than one global batch to "
                          "train on", field="validation.eval_iters", value=validation.eval_iters,
                          fix=f"lower validation.eval_iters (at most {max(total // gbs - 1, 0)} here), or build "
                              "more rows")
    index = held_out_index(total, count)
    keep = np.ones(total, dtype=bool)
    keep[index] = False
    train_rows = subset(all_rows, np.flatnonzero(keep))
    held_rows = subset(all_rows, index)
    pad_id = int((getattr(data, "meta", None) or {}).get("pad_id", 0))
    train = dataclasses.replace(data, rows_sha256=rows_sha256(train_rows), num_rows=train_rows.num_rows,
                                _rows=train_rows)
    held = HeldOut(rows=held_rows, rows_sha256=rows_sha256(held_rows), eval_iters=validation.eval_iters,
                   eval_interval=validation.eval_interval, index=index, pad_id=pad_id)
    return train, held
