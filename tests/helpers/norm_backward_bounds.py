"""The exact gradients of the post-expert norm (fp64 autograd of the chain) and the fp32 error bounds that
tests/unit/test_norm_backward.py derives, shared by its interpreter checks and the GPU test."""

from __future__ import annotations

import torch

from muse_stack.engines.mcore.chains import weighted_gain_first_norm

U = 2.0**-24
EPS = 1e-6


def inputs(rows: int, width: int, seed: int, device: str = "cpu"):
    """bf16 expert outputs and gradients, an fp32 gain and routing weights in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * 2).bfloat16()
    w = torch.randn(width, generator=gen) * 0.3
    p = torch.rand(rows, generator=gen)
    dy = torch.randn(rows, width, generator=gen).bfloat16()
    return tuple(t.to(device) for t in (x, w, p, dy))


def exact(x, w, p, dy, eps: float = EPS):
    """The chain's gradients by autograd in fp64, and the error bounds (see the test's docstring)."""
    x64, w64, p64 = (t.double().requires_grad_() for t in (x, w, p))
    weighted_gain_first_norm.__wrapped__(x64, w64, p64, eps).backward(dy.double())
    with torch.no_grad():
        g = 1 + w.double()
        z = x.double() * g
        r = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
        zh, dyp = z * r, dy.double() * p.double()[:, None]
        width = x.shape[1]
        dz_err = (width + 10) * U * r * (dyp.abs() + zh.abs() * (dyp * zh).abs().mean(-1, keepdim=True))
        dz = r * (dyp - zh * (dyp * zh).mean(-1, keepdim=True))
        bounds = {"dx": dz_err * g.abs(),
                  "dw": (dz_err * x.double().abs()).sum(0) + x.shape[0] * U * (dz * x.double()).abs().sum(0),
                  "dp": (width + 10) * U * (dy.double() * zh).abs().sum(-1)}
    return x64.grad, w64.grad, p64.grad, bounds


def bf16_spacing(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-126))) - 7)
