"""One Adam update in fp64 from fp32 inputs, and the fp32 error bounds of tests/unit/test_adam_step.py, shared by its
interpreter checks and the GPU test (muse_stack.engines.mcore.adam_step against TE's FusedAdam).

The kernels compute in fp32 (unit roundoff u = 2^-24) with the constants in fp32: beta1, beta2, 1 - beta1,
1 - beta2, eps, the decay and the learning rate each rounded once, the bias corrections given. The reference
uses the same fp32 constants, so what is bounded is the arithmetic alone. Per element, to first order in u
(each operation rounds once; a product feeding a sum may be rounded on its own or inside an FMA, so both are
counted):

- L2 mode: the gradient with the decay, ``g + d w``: u |g + d w| (and u |d w| for the product);
- ``m = b1 m + c1 g``: 3 u (|b1 m| + |c1 g|), plus c1 times the gradient's error;
- ``v = b2 v + (c2 g) g``: 4 u (|b2 v| + c2 g^2), plus 2 c2 |g| times the gradient's error;
- the denominator ``sqrt(v / bc2) + eps``: relative error half of v's and of the division's, plus the square
  root's and the sum's (v and eps are non-negative, so nothing cancels);
- the ratio ``(m / bc1) / denom``: m's error over bc1 denom, plus |ratio| times the denominator's relative
  error and two divisions' 2 u;
- AdamW's update ``ratio + d w``: the ratio's error plus 2 u |update| + u |d w|;
- the master ``w - lr update``: u |w'| + u lr |update| + lr times the update's error.

The second-order terms (products of two of these) are covered by a factor of 2 on every bound. The bf16
weight is the master rounded to nearest-even: checked exactly, not bounded.
"""

from __future__ import annotations

import numpy as np
import torch

U = 2.0**-24
SAFETY = 2.0


def f32(x: float) -> float:
    return float(np.float32(x))


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """``1 - beta^step`` as TE's host code: the fp32 beta raised in double, rounded to fp32."""
    return f32(1.0 - f32(beta1) ** step), f32(1.0 - f32(beta2) ** step)


def reference(g, w, m, v, *, beta1, beta2, eps, decay, lr, bc1, bc2, adam_w=True):
    """The update in fp64 from the fp32 tensors: (master, m, v) and a bound on each's fp32 error."""
    b1, b2 = f32(beta1), f32(beta2)
    c1, c2 = float(np.float32(1) - np.float32(beta1)), float(np.float32(1) - np.float32(beta2))
    lr, eps, d = f32(lr), f32(eps), f32(decay)
    g, w, m, v = (t.detach().double().cpu() for t in (g, w, m, v))
    if adam_w:
        dg = torch.zeros_like(g)
    else:
        g = g + d * w
        dg = U * (g.abs() + (d * w).abs())
    m1 = b1 * m + c1 * g
    v1 = b2 * v + c2 * g * g
    dm = 3 * U * ((b1 * m).abs() + (c1 * g).abs()) + c1 * dg
    dv = 4 * U * ((b2 * v).abs() + c2 * g * g) + 2 * c2 * g.abs() * dg
    denom = (v1 / bc2).sqrt() + eps
    rel_v = torch.where(v1 > 0, dv / v1.clamp_min(1e-300), torch.zeros_like(v1))
    rel_denom = 0.5 * (rel_v + U) + 2 * U
    ratio = (m1 / bc1) / denom
    dratio = dm / (bc1 * denom) + ratio.abs() * (rel_denom + 2 * U)
    update = ratio + d * w if adam_w else ratio
    dupdate = dratio + (2 * U * update.abs() + U * (d * w).abs() if adam_w else 0)
    w1 = w - lr * update
    dw = U * w1.abs() + U * lr * update.abs() + lr * dupdate
    return (w1, m1, v1), (SAFETY * dw, SAFETY * dm, SAFETY * dv)


def within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> tuple[bool, float]:
    """Whether every element of ``got`` is within ``bound`` of ``exact``, and the largest error over its bound."""
    err = (got.detach().double().cpu() - exact).abs()
    worst = float((err / bound.clamp_min(1e-300)).max()) if err.numel() else 0.0
    return bool((err <= bound).all()), worst


def bf16_nearest_even(master: torch.Tensor) -> torch.Tensor:
    """torch's fp32 -> bf16 conversion, round to nearest-even."""
    return master.detach().to(torch.bfloat16)
