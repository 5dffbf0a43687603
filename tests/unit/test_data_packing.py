"""Packing: the alignment rule, first-fit decreasing properties, packed rows."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_stack.data.builders import build_packed
from muse_stack.data.chat import Tokenized
from muse_stack.data.packing import align_up, first_fit_decreasing, pack_alignment
from muse_stack.util.errors import LayoutError
from muse_stack.recipes.schema import Batch, Layout


@pytest.mark.parametrize("tp,cp,sp,expected", [
    (4, 2, True, 8),    # sft-192-32k: lcm(2*2, 4*2) = 8
    (4, 4, True, 16),   # coderforge 64k: lcm(2*4, 4*4) = 16
    (4, 2, False, 4),   # CP without sequence parallel: 2*CP
    (4, 1, True, 1),    # no CP
    (1, 3, True, 6),    # lcm(6, 3)
])
def test_pack_alignment_rule(tp, cp, sp, expected):
    assert pack_alignment(Layout(tp=tp, cp=cp, sequence_parallel=sp)) == expected


def test_recipe_alignment_wins():
    assert pack_alignment(Layout(tp=4, cp=2, sequence_parallel=True), Batch(pack_alignment=32)) == 32


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=0, max_size=80), st.integers(64, 200))
def test_first_fit_decreasing_properties(lengths, capacity):
    packs = first_fit_decreasing(lengths, capacity)
    flat = [i for p in packs for i in p]
    assert sorted(flat) == list(range(len(lengths)))  # every item exactly once
    assert all(sum(lengths[i] for i in p) <= capacity for p in packs)
    assert all(p for p in packs)
    # first fit: replaying the placements longest first, no item fitted into an earlier pack
    where = {i: k for k, p in enumerate(packs) for i in p}
    free = [capacity] * len(packs)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        assert all(free[q] < lengths[i] for q in range(where[i]))
        free[where[i]] -= lengths[i]
    # a consequence of first fit: no two packs could be merged into one
    used = [sum(lengths[i] for i in p) for p in packs]
    assert all(used[a] + used[b] > capacity for a in range(len(used)) for b in range(a + 1, len(used)))


def test_first_fit_is_first_fit():
    # decreasing order 6,5,4,3,2 into 10: 6+4, 5+3+2
    assert first_fit_decreasing([4, 6, 2, 5, 3], 10) == [[1, 0], [3, 4, 2]]


def _convs(lengths, seed=0):
    rs = np.random.RandomState(seed)
    out = []
    for k, n in enumerate(lengths):
        ids = np.full(n, 100 + k, dtype=np.int32)  # a conversation's tokens all carry its own id
        mask = (rs.rand(n) < 0.5).astype(np.uint8)
        mask[-1] = 1
        out.append(Tokenized(ids=ids, mask=mask))
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=40), st.sampled_from([1, 2, 8, 16]),
       st.sampled_from(["drop", "truncate"]), st.integers(0, 2**31 - 1))
def test_packed_rows_properties(lengths, alignment, overlong, seed):
    size = 64
    convs = _convs(lengths)
    rows, stats = build_packed(convs, size, alignment, seed, eos_id=2, pad_id=0, overlong=overlong, gbs=2)
    seen = []
    for r in range(rows.num_rows):
        assert rows.ids.shape[1] == size
        pos = 0
        for ln, pl in zip(rows.seq_lengths[r], rows.seq_lengths_padded[r]):
            assert pl % alignment == 0 and ln <= pl < ln + alignment
            seg = rows.ids[r, pos:pos + ln]
            k = int(seg[0]) - 100
            body = seg[:-1] if ln == lengths[k] + 1 else seg  # the EOS follows a whole conversation
            assert (body == 100 + k).all() and len(body) == min(lengths[k], ln)  # one conversation, unsplit
            if ln == lengths[k] + 1:
                assert seg[-1] == 2 and rows.mask[r, pos + ln - 1] == 0
            else:
                assert overlong == "truncate" and ln == size
            assert (rows.ids[r, pos + ln:pos + pl] == 0).all() and not rows.mask[r, pos + ln:pos + pl].any()
            seen.append(k)
            pos += pl
        assert pos <= size and (rows.ids[r, pos:] == 0).all()
    long = [k for k, n in enumerate(lengths) if n + 1 > size]
    assert sorted(seen) == sorted(set(seen))  # every kept conversation exactly once
    if overlong == "drop":
        assert sorted(seen) == [k for k in range(len(lengths)) if k not in long]
        assert stats["dropped_overlong"] == len(long)
    else:
        assert sorted(seen) == list(range(len(lengths))) and stats["truncated_overlong"] == len(long)
    assert stats["packs"] == rows.num_rows and stats["steps_per_epoch"] == rows.num_rows // 2
    real = sum(int(x.sum()) for x in rows.seq_lengths)
    # the stats are rounded to 6 decimals (builders._ratio): |error| <= 5e-7 (+ float64 rounding, < 1e-15)
    assert stats["fill_ratio"] == pytest.approx(real / (rows.num_rows * size), abs=6e-7) if rows.num_rows else True


def test_pack_size_must_divide_by_alignment():
    with pytest.raises(LayoutError) as exc:
        build_packed(_convs([5]), 100, 16, 0, eos_id=2, pad_id=0)
    assert exc.value.field == "data.packed_size"


def test_align_up():
    assert [align_up(n, 8) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
