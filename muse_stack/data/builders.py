"""The three row builders: ``fixed`` (the B200 record's), ``packed`` (Megatron-Bridge's) and ``synthetic``.

All randomness is ``numpy.random.RandomState`` (a frozen stream: the same seed gives the same
permutation on every machine and numpy version).

* fixed: conversations in a seeded global permutation, concatenated with an EOS token between
  them (EOS not supervised), cut into consecutive rows of exactly ``N`` tokens; the last row is
  padded at its end with the pad id (mask 0); rows without a supervised token are skipped;
  ``limit`` stops after that many rows.
* packed: each conversation followed by EOS, padded to the alignment multiple, packed whole by
  first-fit decreasing (:mod:`muse_stack.data.packing`) into sequences of ``size`` tokens, each
  pack padded at its end; conversations longer than ``size`` are dropped (``overlong="drop"``)
  or cut to ``size`` tokens (``"truncate"``); conversations without a supervised token are dropped.
* synthetic: a learnable token stream (seeded phrases of 8-16 tokens repeated in a seeded
  order), every token supervised, for benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from muse_stack.data.chat import Tokenized
from muse_stack.data.packing import align_up, check_pack_size, first_fit_decreasing
from muse_stack.data.rows import Rows


def _ratio(a: int, b: int) -> float:
    return round(a / b, 6) if b else 0.0


def build_fixed(convs: Sequence[Tokenized], n: int, seed: int, eos_id: int, pad_id: int,
                limit: int | None = None) -> tuple[Rows, dict[str, Any]]:
    perm = np.random.RandomState(seed).permutation(len(convs))
    eos = (np.asarray([eos_id], np.int32), np.zeros(1, np.uint8))
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    for j, i in enumerate(perm):
        if j:
            ids_parts.append(eos[0])
            mask_parts.append(eos[1])
        ids_parts.append(convs[i].ids)
        mask_parts.append(convs[i].mask)
    stream_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
    stream_mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8)
    total = int(stream_ids.shape[0])
    num = -(-total // n)
    padding = num * n - total
    ids = np.full(num * n, pad_id, dtype=np.int32)
    mask = np.zeros(num * n, dtype=np.uint8)
    ids[:total] = stream_ids
    mask[:total] = stream_mask
    ids, mask = ids.reshape(num, n), mask.reshape(num, n)
    keep = np.flatnonzero(mask.sum(axis=1) > 0)
    skipped = num - int(keep.shape[0])
    if limit is not None:
        keep = keep[:limit]
    ids, mask = ids[keep], mask[keep]
    lengths = [np.asarray([n - (padding if k == num - 1 else 0)], np.int32) for k in keep]
    pad_tokens = int(sum(n - int(x[0]) for x in lengths))
    rows = Rows(ids=ids, mask=mask, seq_lengths=lengths, seq_lengths_padded=lengths, packed=False)
    sup = int(mask.sum())
    stats = {"builder": "fixed", "conversations": len(convs), "stream_tokens": total, "rows": rows.num_rows,
             "row_tokens": n, "skipped_rows_without_targets": skipped, "padding_tokens": pad_tokens,
             "supervised_tokens": sup, "supervised_token_ratio": _ratio(sup, rows.num_rows * n)}
    return rows, stats


def build_packed(convs: Sequence[Tokenized], size: int, alignment: int, seed: int, eos_id: int, pad_id: int,
                 overlong: str = "drop", gbs: int | None = None) -> tuple[Rows, dict[str, Any]]:
    check_pack_size(size, alignment)
    perm = np.random.RandomState(seed).permutation(len(convs))
    items: list[tuple[np.ndarray, np.ndarray]] = []
    media: list[int] = []  # the conversation each item is (its images travel with it)
    with_images = bool(convs) and hasattr(convs[0], "images")
    dropped_overlong = truncated = dropped_unsupervised = 0
    for i in perm:
        ids = np.concatenate([convs[i].ids, np.asarray([eos_id], np.int32)])
        mask = np.concatenate([convs[i].mask, np.zeros(1, np.uint8)])
        if ids.shape[0] > size:
            if overlong != "truncate" or with_images:  # an image's placeholders are never cut
                dropped_overlong += 1
                continue
            ids, mask = ids[:size], mask[:size]
            truncated += 1
        if not mask.any():
            dropped_unsupervised += 1
            continue
        items.append((ids, mask))
        media.append(int(i))
    lengths = [int(x[0].shape[0]) for x in items]
    padded = [align_up(x, alignment) for x in lengths]
    packs = first_fit_decreasing(padded, size) if items else []
    ids = np.full((len(packs), size), pad_id, dtype=np.int32)
    mask = np.zeros((len(packs), size), dtype=np.uint8)
    seq_lengths, seq_padded = [], []
    for r, members in enumerate(packs):
        pos = 0
        for m in members:
            ids[r, pos:pos + lengths[m]] = items[m][0]
            mask[r, pos:pos + lengths[m]] = items[m][1]
            pos += padded[m]
        seq_lengths.append(np.asarray([lengths[m] for m in members], np.int32))
        seq_padded.append(np.asarray([padded[m] for m in members], np.int32))
    rows = Rows(ids=ids, mask=mask, seq_lengths=seq_lengths, seq_lengths_padded=seq_padded, packed=True)
    if with_images:  # each pack's images, in the order of its members (so of their placeholders)
        rows.images = [[img for m in members for img in convs[media[m]].images] for members in packs]
        rows.image_grids = [np.asarray([g for m in members for g in convs[media[m]].grids], np.int32).reshape(-1, 3)
                            for members in packs]
    real, aligned = sum(lengths), sum(padded)
    cap = len(packs) * size
    sup = int(mask.sum())
    stats = {"builder": "packed", "conversations": len(convs), "kept_conversations": len(items),
             "dropped_overlong": dropped_overlong, "truncated_overlong": truncated,
             "dropped_without_targets": dropped_unsupervised, "packs": len(packs), "rows": len(packs),
             "pack_size": size, "row_tokens": size, "alignment": alignment, "tokens": real,
             "alignment_padding_tokens": aligned - real, "padding_tokens": cap - real,
             "fill_ratio": _ratio(real, cap), "supervised_tokens": sup, "supervised_token_ratio": _ratio(sup, cap),
             "gbs": gbs, "steps_per_epoch": (len(packs) // gbs) if gbs else None}
    if with_images:
        stats["images"] = sum(len(x) for x in rows.images)
    return rows, stats


def build_synthetic(num_rows: int, n: int, vocab_size: int, seed: int) -> tuple[Rows, dict[str, Any]]:
    rs = np.random.RandomState(seed)
    low = 1 if vocab_size > 1 else 0
    phrases = [rs.randint(low, vocab_size, size=rs.randint(8, 17)).astype(np.int32) for _ in range(64)]
    need = num_rows * n
    parts, have = [], 0
    while have < need:
        p = phrases[rs.randint(len(phrases))]
        parts.append(p)
        have += p.shape[0]
    ids = np.concatenate(parts)[:need].reshape(num_rows, n)
    mask = np.ones_like(ids, dtype=np.uint8)
    lengths = [np.asarray([n], np.int32) for _ in range(num_rows)]
    rows = Rows(ids=ids, mask=mask, seq_lengths=lengths, seq_lengths_padded=lengths, packed=False)
    stats = {"builder": "synthetic", "rows": num_rows, "row_tokens": n, "vocab_size": vocab_size,
             "padding_tokens": 0, "supervised_tokens": int(mask.sum()), "supervised_token_ratio": 1.0}
    return rows, stats
