"""On a GPU: the vision attention as one variable-length call (PyTorch's ``varlen_attn``,
``engine_options.towers_varlen_attention``) against the grouped calls the tower ships (one
``scaled_dot_product_attention`` per group size), at the released tower's heads and head width.

Bound. Both kernels compute the same attention in bf16 with fp32 accumulation; they differ in their blocking (so in
where the softmax weights are rounded to bf16 before the second product) and accumulation order. Their rounding
errors are of the same size and independent where they block differently, so the varlen kernel's distance from the
exact (float64) attention is within sqrt(2) of the grouped calls' distance from it (the convention of
tests/unit/test_towers_bf16_activations.py), for the output and for the gradients of q, k and v."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_varlen_attention_rounds_no_more_than_the_grouped_calls():
    from muse_stack.models.muse_spark.vision import (attend_groups, attend_segments, attention_groups, segments,
                                                     varlen_kernel)

    if varlen_kernel() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn")
    torch.manual_seed(0)
    # window ids of two frames in window order: whole windows of 1,024 patches and partial ones of 512, 384 and 96
    sizes = [1024, 1024, 512, 1024, 384, 96, 1024, 512]
    group = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).cuda()
    n, heads, dim = sum(sizes), 16, 96
    qkv = [torch.randn(n, heads, dim, device="cuda", dtype=torch.float64) for _ in range(3)]
    weights = torch.randn(n, heads, dim, device="cuda", dtype=torch.float64)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in qkv]
        out = fn(*leaves)
        (out.double() * weights).sum().backward()
        return [out.detach().double(), *(t.grad.double() for t in leaves)]

    exact = run(lambda q, k, v: attend_groups(q, k, v, attention_groups(group)), torch.float64)
    grouped = run(lambda q, k, v: attend_groups(q, k, v, attention_groups(group)), torch.bfloat16)
    varlen = run(lambda q, k, v: attend_segments(q, k, v, segments(group)), torch.bfloat16)
    for name, e, g, v in zip(("output", "dq", "dk", "dv"), exact, grouped, varlen, strict=True):
        assert (v - e).norm() <= math.sqrt(2) * (g - e).norm(), name
