"""Deterministic training micro-batches from built rows.

Each epoch visits the rows in ``RandomState([seed, epoch]).permutation`` order (stored order when
``seed`` is None); a step takes ``micro_batch_size * world_size`` consecutive rows of that order and
rank ``r`` gets the ``r``-th slice of ``micro_batch_size`` rows, so data-parallel ranks see disjoint
rows. The rows that do not fill a whole step at the end of an epoch are left out of that epoch.

A batch is a dict of torch tensors:

* ``input_ids`` [B, N] long: the row tokens.
* ``labels`` [B, N] long: already shifted, ``labels[:, t] = input_ids[:, t+1]``; -100 where
  ``loss_mask`` is 0. The model must not shift again.
* ``loss_mask`` [B, N] float32: 1 where ``labels[:, t]`` is a supervised target within the same
  sequence (never across a packed-sequence boundary, never at the last position).
* ``position_ids`` [B, N] long: restart at 0 at each packed sequence; alignment and end-of-row
  padding continue the positions of the sequence before it.
* ``segment_ids`` [B, N] long: index of the packed sequence within its row (0, 1, ...); end-of-row
  padding belongs to the row's last sequence.
* ``cu_seqlens`` / ``cu_seqlens_padded`` [S+1] int32: cumulative sequence lengths over the
  flattened batch (THD layout), without and with padding; ``cu_seqlens_padded[-1] == B*N``.
* ``max_seqlen`` int: the longest padded sequence in the batch.
* image-text rows only, when the batch holds an image: ``pixel_values`` [patches, 1176] float32
  and ``image_grid_thw`` [images, 3] long, the images in the order of their placeholders in the
  flattened ``input_ids`` (:func:`muse_stack.data.multimodal.media_batch`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from muse_stack.data.rows import Rows
from muse_stack.util.errors import RecipeError


def _row_segments(rows: Rows, r: int) -> tuple[np.ndarray, np.ndarray]:
    n = rows.row_tokens
    lens = rows.seq_lengths[r].astype(np.int64)
    padded = rows.seq_lengths_padded[r].astype(np.int64).copy()
    padded[-1] += n - int(padded.sum())  # end-of-row padding joins the last sequence
    return lens, padded


def collate(rows: Rows, index: np.ndarray) -> dict[str, Any]:
    import torch

    ids = rows.ids[index].astype(np.int64)
    mask = rows.mask[index]
    seg = np.zeros_like(ids)
    pos = np.zeros_like(ids)
    cu, cu_pad = [0], [0]
    max_len = 0
    for b, r in enumerate(index):
        lens, padded = _row_segments(rows, int(r))
        start = 0
        for s, (ln, pl) in enumerate(zip(lens, padded)):
            seg[b, start:start + pl] = s
            pos[b, start:start + pl] = np.arange(pl)
            cu.append(cu_pad[-1] + int(ln))
            cu_pad.append(cu_pad[-1] + int(pl))
            max_len = max(max_len, int(pl))
            start += pl
    loss = np.zeros(ids.shape, dtype=np.float32)
    loss[:, :-1] = mask[:, 1:] * (seg[:, 1:] == seg[:, :-1])
    labels = np.full(ids.shape, -100, dtype=np.int64)
    labels[:, :-1] = np.where(loss[:, :-1] > 0, ids[:, 1:], -100)
    out = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
           "loss_mask": torch.from_numpy(loss), "position_ids": torch.from_numpy(pos),
           "segment_ids": torch.from_numpy(seg), "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
           "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32), "max_seqlen": max_len}
    if rows.images is not None:  # image-text rows: the batch's images in placeholder order
        from muse_stack.data.multimodal import media_batch

        images = [img for r in index for img in rows.images[int(r)]]
        if images:
            grids = np.concatenate([rows.image_grids[int(r)] for r in index]).reshape(-1, 3)
            out.update(media_batch(images, grids, rows.image_spec))
    return out


def steps_per_epoch(num_rows: int, micro_batch_size: int, world_size: int = 1) -> int:
    return num_rows // (micro_batch_size * world_size)


class BatchStream:
    """The micro-batches of one rank, in the order the module doc describes, that can say where it
    stands (:meth:`position`) and start there again (:meth:`seek`) without producing the batches
    before it. ``epochs=None`` repeats without end."""

    def __init__(self, rows: Rows, micro_batch_size: int, seed: int | None = 0, rank: int = 0, world_size: int = 1,
                 epochs: int | None = 1, pad_id: int = 0) -> None:
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise RecipeError("bad batch split", field="batch.mbs", value=(micro_batch_size, rank, world_size),
                              fix="give micro_batch_size >= 1 and 0 <= rank < world_size")
        self.rows, self.mbs, self.seed, self.rank, self.world_size = rows, micro_batch_size, seed, rank, world_size
        self.epochs, self.pad_id = epochs, pad_id
        self.per_step = micro_batch_size * world_size
        self.steps = steps_per_epoch(rows.num_rows, micro_batch_size, world_size)
        if self.steps == 0:
            raise RecipeError(f"{rows.num_rows} rows cannot fill one step of {self.per_step} rows", field="batch.mbs",
                              value=micro_batch_size, fix="build more rows (data.rows, more conversations) or lower "
                              "the micro-batch size / data-parallel size")
        self.epoch, self.step = 0, 0  #: the next micro-step to produce: its epoch, and its index in that epoch
        self._order: tuple[int, np.ndarray] | None = None

    def __iter__(self) -> "BatchStream":
        return self

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            order = (np.arange(self.rows.num_rows) if self.seed is None
                     else np.random.RandomState([self.seed & 0xFFFFFFFF, epoch]).permutation(self.rows.num_rows))
            self._order = (epoch, order)
        return self._order[1]

    def __next__(self) -> dict[str, Any]:
        if self.step >= self.steps:
            self.epoch, self.step = self.epoch + 1, 0
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        lo = self.step * self.per_step + self.rank * self.mbs
        self.step += 1
        return collate(self.rows, self._epoch_order(self.epoch)[lo:lo + self.mbs])

    def position(self) -> dict[str, Any]:
        """Where the data stands, independent of the rank: the epoch, and the rows of that epoch's
        order that every rank together has consumed; with what order it is a position in."""
        epoch, step = (self.epoch + 1, 0) if self.step >= self.steps else (self.epoch, self.step)
        return {"epoch": epoch, "row": step * self.per_step, "seed": self.seed, "rows": self.rows.num_rows}

    def seek(self, position: dict[str, Any]) -> None:
        """Continue from a :meth:`position`, saved by this or another data-parallel size: with the
        same global batch a position after a whole step is a multiple of every rank's share. One
        that is not (a run continued with another global or micro-batch, ``--allow-change``)
        continues at the next whole micro-step, the rows between left out of that epoch and logged."""
        from muse_stack.util.errors import InputError

        fix = "resume with the data the run trained on (its rows and data_seed), or start a new run"
        if position.get("rows") != self.rows.num_rows or position.get("seed") != self.seed:
            raise InputError(f"the checkpoint's data position is in an order of {position.get('rows')} rows with seed "
                             f"{position.get('seed')}, not of these {self.rows.num_rows} rows with seed {self.seed}",
                             field="training.data_seed", value=self.seed, fix=fix)
        epoch, row = position.get("epoch"), position.get("row")
        if not (isinstance(epoch, int) and isinstance(row, int) and epoch >= 0 and row >= 0):
            raise InputError(f"the checkpoint's data position (epoch {epoch!r}, row {row!r}) is not a position",
                             field="--resume", value=position, fix=fix)
        step = -(-row // self.per_step)
        if step * self.per_step != row:
            import logging

            logging.getLogger("muse_stack.run").warning(
                "the data position (row %d of epoch %d) is not a boundary of %d-row micro-steps: rows %d-%d of that "
                "epoch's order are left out", row, epoch, self.per_step, row, step * self.per_step - 1)
        self.epoch, self.step = epoch, step


def iterate(rows: Rows, micro_batch_size: int, seed: int | None = 0, rank: int = 0, world_size: int = 1,
            epochs: int | None = 1, pad_id: int = 0) -> BatchStream:
    """Micro-batches for ``rank`` of ``world_size``; ``epochs=None`` repeats without end."""
    return BatchStream(rows, micro_batch_size, seed=seed, rank=rank, world_size=world_size, epochs=epochs,
                       pad_id=pad_id)
