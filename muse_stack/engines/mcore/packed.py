"""Packed rows as one THD token stream (pure torch; the engine adds TE's CP split and
megatron-core's ``PackedSeqParams``).

A micro-batch of B packed rows of N tokens becomes one stream of B x N tokens. Each packed
sequence, with the alignment padding that follows it, is one THD sequence: the reference
engine lets padding attend within its sequence too, and padding is never a supervised
target, so supervised losses are the same. ``cu_seqlens_padded`` of the batch is already over
the flattened rows (a row start is always a sequence start).
"""

from __future__ import annotations

from typing import Any

import torch

from muse_stack.util.errors import RecipeError

STREAM_KEYS = ("input_ids", "labels", "loss_mask")


def packed_stream(mb: dict[str, Any], cp_size: int = 1, pack_alignment: int | None = None) -> dict[str, Any]:
    """``{input_ids, labels, loss_mask}`` as [1, B x N], the sequences' ``cu_seqlens`` (int32)
    and ``max_seqlen``. Under CP every sequence must split into 2 x CP equal chunks."""
    out: dict[str, Any] = {k: mb[k].reshape(1, -1) for k in STREAM_KEYS}
    cu = torch.as_tensor(mb["cu_seqlens_padded"], dtype=torch.int32).reshape(-1)
    total = out["input_ids"].shape[1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise RecipeError("the packed sequences' boundaries do not cover the micro-batch", field="cu_seqlens_padded",
                          value=cu.tolist()[:8], rule=f"cumulative lengths from 0 to {total}",
                          fix="rebuild the rows (muse-stack data build)")
    if cp_size > 1:
        lengths = (cu[1:] - cu[:-1]).tolist()
        bad = [n for n in lengths if n % (2 * cp_size)]
        if bad:
            raise RecipeError("packed sequences must split into 2 x CP equal chunks", field="batch.pack_alignment",
                              value=pack_alignment,
                              rule=f"every padded sequence length divisible by {2 * cp_size} (e.g. {bad[:4]})",
                              fix=f"set batch.pack_alignment to a multiple of {2 * cp_size} and rebuild the rows")
    out["cu_seqlens"] = cu
    out["max_seqlen"] = int(mb.get("max_seqlen") or int((cu[1:] - cu[:-1]).max()))
    return out
