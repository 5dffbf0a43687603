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
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from typing import Any

import numpy as np

from muse_stack.data.rows import Rows
from muse_stack.errors import RecipeError


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
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss), "position_ids": torch.from_numpy(pos),
            "segment_ids": torch.from_numpy(seg), "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor(cu_pad, dtype=torch.int32), "max_seqlen": max_len}


def steps_per_epoch(num_rows: int, micro_batch_size: int, world_size: int = 1) -> int:
    return num_rows // (micro_batch_size * world_size)


def iterate(rows: Rows, micro_batch_size: int, seed: int | None = 0, rank: int = 0, world_size: int = 1,
            epochs: int | None = 1, pad_id: int = 0) -> Iterator[dict[str, Any]]:
    """Micro-batches for ``rank`` of ``world_size``; ``epochs=None`` repeats without end."""
    if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise RecipeError("bad batch split", field="batch.mbs", value=(micro_batch_size, rank, world_size),
                          fix="give micro_batch_size >= 1 and 0 <= rank < world_size")
    per_step = micro_batch_size * world_size
    steps = steps_per_epoch(rows.num_rows, micro_batch_size, world_size)
    if steps == 0:
        raise RecipeError(f"{rows.num_rows} rows cannot fill one step of {per_step} rows", field="batch.mbs",
                          value=micro_batch_size, fix="build more rows (data.rows, more conversations) or lower the "
                          "micro-batch size / data-parallel size")
    for epoch in (count() if epochs is None else range(epochs)):
        if seed is None:
            order = np.arange(rows.num_rows)
        else:
            order = np.random.RandomState([seed & 0xFFFFFFFF, epoch]).permutation(rows.num_rows)
        for s in range(steps):
            lo = s * per_step + rank * micro_batch_size
            yield collate(rows, order[lo:lo + micro_batch_size])
