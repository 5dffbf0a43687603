"""The clip's scale kernel as compiled for the GPU against TE's multi_tensor_scale_tensor, the
kernel megatron-core's device clip path calls without it (tests/unit/test_clip_scale.py: the same
kernel under Triton's interpreter, on any machine)."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("coeff", [0.5, 1.0 / 3.0, 1e-7, 1.0, math.nan])
def test_matches_te_multi_tensor_scale_tensor_bitwise(coeff):
    pytest.importorskip("transformer_engine.pytorch")  # loads TE's torch extension as transformer_engine_torch
    import transformer_engine_torch as tex
    from muse_stack.engines.mcore import clip_scale

    gen = torch.Generator(device="cuda").manual_seed(1)
    buffer = torch.randn(5_000_003, device="cuda", generator=gen)
    buffer[:3] = torch.tensor([math.inf, -math.inf, math.nan])
    cuts = [(0, 1_000_000), (1_000_000, 4_000_000), (4_000_064, 5_000_003)]
    mine = buffer
    theirs = buffer.clone()
    ours, te = [mine[a:b] for a, b in cuts], [theirs[a:b] for a, b in cuts]
    c = torch.tensor([coeff], device="cuda")
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    clip_scale.scale_unless_one(2048 * 32, flag, [ours, ours], c)
    tex.multi_tensor_scale_tensor(2048 * 32, flag, [te, te], c)
    assert len(clip_scale.flat_spans(ours)) == 2
    for a, b in zip(ours, te):
        # every number bitwise; a NaN stays a NaN (TE's multiplication by 1 returns the GPU's
        # canonical NaN, the skipped pass keeps the NaN it found: the payload is not kept equal)
        finite = ~torch.isnan(b)
        assert torch.equal(torch.isnan(a), ~finite)
        assert torch.equal(a[finite].view(torch.int32), b[finite].view(torch.int32))
