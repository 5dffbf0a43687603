"""Packed rows as one THD stream for the megatron-core engine (the pure part; CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_stack.data.batches import collate
from muse_stack.data.builders import build_packed
from muse_stack.data.chat import Tokenized
from muse_stack.engines.mcore.packed import packed_stream
from muse_stack.util.errors import RecipeError


def rows_for(lengths, alignment, size=64):
    convs = [Tokenized(ids=np.full(n, 100 + k, dtype=np.int32), mask=np.ones(n, dtype=np.uint8))
             for k, n in enumerate(lengths)]
    rows, _ = build_packed(convs, size, alignment, 0, eos_id=2, pad_id=0, overlong="drop", gbs=1)
    return rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=2, max_size=30), st.sampled_from([1, 4, 8]), st.integers(1, 3))
def test_stream_keeps_every_sequence_whole_and_in_order(lengths, alignment, mbs):
    rows = rows_for(lengths, alignment)
    if rows.num_rows < mbs:
        return
    mb = collate(rows, np.arange(mbs))
    out = packed_stream(mb, cp_size=1)
    n = mb["input_ids"].numel()
    assert out["input_ids"].shape == (1, n) and torch.equal(out["input_ids"][0], mb["input_ids"].reshape(-1))
    cu = out["cu_seqlens"]
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == n
    width = mb["input_ids"].shape[1]
    starts = set(cu[:-1].tolist())
    assert all(r * width in starts for r in range(mbs))  # every row starts a sequence
    # a sequence never mixes two conversations; the labels never cross a boundary
    ids, labels = out["input_ids"][0], out["labels"][0]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        body = [t for t in ids[a:b].tolist() if t >= 100]
        assert len(set(body)) <= 1
        assert int(labels[b - 1]) == -100
    assert out["max_seqlen"] == int((cu[1:] - cu[:-1]).max())


def test_context_parallel_needs_sequences_in_two_cp_chunks():
    aligned = collate(rows_for([5, 9, 13, 20], 8), np.arange(1))
    assert packed_stream(aligned, cp_size=4)["cu_seqlens"].numel() >= 2  # 2 x CP = 8 divides every length
    loose = collate(rows_for([5, 9, 13, 20], 1), np.arange(1))
    with pytest.raises(RecipeError) as err:
        packed_stream(loose, cp_size=2, pack_alignment=None)
    assert err.value.field == "batch.pack_alignment" and "multiple of 4" in err.value.fix


def test_boundaries_must_cover_the_micro_batch():
    mb = collate(rows_for([5, 9], 1), np.arange(1))
    mb["cu_seqlens_padded"] = mb["cu_seqlens_padded"][:-1]
    with pytest.raises(RecipeError) as err:
        packed_stream(mb)
    assert err.value.field == "cu_seqlens_padded"
