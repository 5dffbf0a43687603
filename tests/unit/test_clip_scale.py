"""The gradient clip's scale that skips unclipped steps (muse_stack.engines.mcore.clip_scale).

Its Triton kernel runs here under Triton's interpreter (TRITON_INTERPRET=1, read when the kernel
is defined: the module is reloaded with it set). On a GPU, tests/gpu/test_clip_scale_gpu.py compares it
bitwise with TE's multi_tensor_scale_tensor, the kernel megatron-core calls otherwise.
"""

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def cs():
    """clip_scale with its kernel defined under Triton's interpreter (CPU tensors)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    from muse_stack.engines.mcore import clip_scale

    yield importlib.reload(clip_scale)
    mp.undo()
    importlib.reload(clip_scale)


def _views(buffer: torch.Tensor, pieces: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``buffer`` at (offset, length), some reshaped as parameters are."""
    out = []
    for i, (start, length) in enumerate(pieces):
        v = buffer[start:start + length]
        out.append(v.view(length // 2, 2) if i % 3 == 1 and length % 2 == 0 else v)
    return out


@st.composite
def layouts(draw):
    """Gradients as megatron-core holds them: views into one buffer, mostly back to back, some
    with a gap (padding, another bucket) before them, handed over in any order."""
    pieces, at = [], 0
    for _ in range(draw(st.integers(1, 12))):
        at += draw(st.sampled_from([0, 0, 0, 1, 5]))
        length = draw(st.integers(1, 300))
        pieces.append((at, length))
        at += length
    order = draw(st.permutations(range(len(pieces))))
    return [pieces[i] for i in order], at + 3


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_spans_cover_each_gradient_once_and_join_only_neighbours(cs, layout):
    pieces, size = layout
    buffer = torch.zeros(size)
    spans = cs.flat_spans(_views(buffer, pieces))
    covered = torch.zeros(size, dtype=torch.int)
    for span in spans:
        covered[span.storage_offset():span.storage_offset() + span.numel()] += 1
    expected = torch.zeros(size, dtype=torch.int)
    for start, length in pieces:
        expected[start:start + length] = 1
    assert torch.equal(covered, expected)  # every element once; no padding between them
    runs = sum(1 for i in range(size) if expected[i] and (i == 0 or not expected[i - 1]))
    assert len(spans) == runs  # neighbours are joined: one launch per run of back-to-back gradients


def test_spans_keep_separate_buffers_apart(cs):
    a, b = torch.zeros(8), torch.zeros(8)
    spans = cs.flat_spans([a[4:], b[:4], a[:4]])
    assert sorted((s.untyped_storage().data_ptr(), s.numel()) for s in spans) == sorted(
        [(a.untyped_storage().data_ptr(), 8), (b.untyped_storage().data_ptr(), 4)])


COEFFICIENTS = [0.5, 1.0 / 3.0, 1e-7, 1.0, math.nan]


@pytest.mark.parametrize("coeff", COEFFICIENTS)
def test_in_place_scale_is_the_fp32_product_bitwise(cs, coeff):
    """megatron-core's call: each gradient is both source and target. The result is
    ``grad * coefficient`` in fp32, bitwise (TE's kernel computes the same product); at a
    coefficient of exactly 1 the gradients are as they were, which is why no pass is needed."""
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randn(3 * cs.BLOCK + 17, generator=gen)
    buffer[5], buffer[6], buffer[7] = math.inf, -math.inf, math.nan
    grads = _views(buffer, [(0, 10), (10, 2 * cs.BLOCK), (2 * cs.BLOCK + 10, cs.BLOCK), (3 * cs.BLOCK + 12, 5)])
    expected = [g * torch.tensor(coeff, dtype=torch.float32) for g in grads]
    gap = buffer[3 * cs.BLOCK + 10:3 * cs.BLOCK + 12].clone()
    cs.scale_unless_one(2048 * 32, torch.zeros(1, dtype=torch.int), [grads, grads], torch.tensor([coeff]))
    for g, e in zip(grads, expected):
        assert torch.equal(g.view(-1).view(torch.int32), e.view(-1).view(torch.int32))
    assert torch.equal(buffer[3 * cs.BLOCK + 10:3 * cs.BLOCK + 12], gap)  # what lies between is not touched


@pytest.mark.parametrize("coeff", [1.0, 0.25])
def test_out_of_place_always_writes_the_target(cs, coeff):
    """With separate targets a coefficient of 1 still copies: skipping is only right in place."""
    src = [torch.randn(100), torch.randn(7, 3)]
    dst = [torch.full((100,), 9.0), torch.full((7, 3), 9.0)]
    cs.scale_unless_one(0, torch.zeros(1, dtype=torch.int), [src, dst], torch.tensor([coeff]))
    for s, d in zip(src, dst):
        assert torch.equal(d, s * torch.tensor(coeff))


@pytest.mark.parametrize("bad, match", [
    (lambda: ([torch.zeros(4, dtype=torch.bfloat16)], torch.tensor([0.5])), "fp32"),
    (lambda: ([torch.zeros(4, 4).t()], torch.tensor([0.5])), "contiguous"),
    (lambda: ([torch.zeros(4)], torch.tensor([0.5, 0.5])), "one fp32 value"),
    (lambda: ([torch.zeros(4)], torch.tensor([0.5], dtype=torch.float64)), "one fp32 value"),
])
def test_refuses_what_it_cannot_scale_as_te_would(cs, bad, match):
    grads, coeff = bad()
    with pytest.raises(ValueError, match=match):
        cs.scale_unless_one(0, torch.zeros(1, dtype=torch.int), [grads, grads], coeff)
