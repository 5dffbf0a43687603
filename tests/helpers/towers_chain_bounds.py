"""The vision tower's chains compiled against the same chains in plain PyTorch, within the bounds
tests/unit/test_towers_chains.py derives; shared by that CPU test and the GPU test."""

from __future__ import annotations

import torch
from norm_backward_bounds import bf16_spacing

from muse_stack.models.muse_spark.vision import EAGER_CHAINS, VisionChains

#: each fp32 GELU, plain or compiled, is within ERF x |h| of the exact one (checked by :func:`check_chains`)
ERF = 2.0**-20


def check_chains(compiled: VisionChains, *, rows: int, width: int, inner: int, heads: int, device: str) -> None:
    """Each compiled chain against plain PyTorch on the dtypes the engine hands them (fp32 activations, bf16 GEMM
    inputs and outputs): a bf16 output within one bf16 spacing (and, for the GELU, twice the erf bound), the
    residual add equal."""
    torch.manual_seed(2)
    head_dim = width // heads
    x = torch.randn(rows, width, device=device) * 3 + 0.5
    w, b = (torch.randn(width, device=device).to(torch.bfloat16) for _ in range(2))
    t = torch.randn(rows, heads, head_dim, device=device).to(torch.bfloat16)
    angles = torch.rand(rows, head_dim, device=device) * 6
    cos, sin = angles.cos(), angles.sin()
    h = (torch.randn(rows, inner, device=device) * 2).to(torch.bfloat16)
    plain = EAGER_CHAINS
    exact = torch.nn.functional.gelu(h.double())
    for fn in (plain.gelu, compiled.gelu):
        assert ((fn(h, torch.float32, torch.float32).double() - exact).abs() <= h.double().abs() * ERF).all()
    cases = {
        "normed": (plain.normed(x, w, b, 1e-6, torch.bfloat16, 1)[0], compiled.normed(x, w, b, 1e-6, torch.bfloat16, 1)[0],
                   0.0),
        "rope": (plain.rope(t, cos, sin, torch.float32, torch.bfloat16),
                 compiled.rope(t, cos, sin, torch.float32, torch.bfloat16), 0.0),
        "gelu": (plain.gelu(h, torch.float32, torch.bfloat16), compiled.gelu(h, torch.float32, torch.bfloat16),
                 2 * h.float().abs() * ERF),
    }
    for name, (a, c, erf_gap) in cases.items():
        assert c.dtype == a.dtype == torch.bfloat16, name
        gap = (c.float() - a.float()).abs()
        assert (gap <= bf16_spacing(torch.maximum(a.float().abs(), c.float().abs())) + erf_gap).all(), \
            (name, gap.max())
    branch = torch.randn(rows, width, device=device).to(torch.bfloat16)
    assert torch.equal(compiled.residual(x, branch), plain.residual(x, branch))
