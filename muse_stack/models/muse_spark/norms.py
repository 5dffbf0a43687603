"""RMS norms of Muse Spark.

Three kinds of gain appear in the model (``rms(x) = x / sqrt(mean(x^2) + eps)``, computed in
fp32 over the last axis):

* :class:`CenteredRMSNorm` -- ``rms(x) * (1 + w)``: the pre-norms (``input_layernorm``,
  ``pre_feedforward_layernorm``) and ``pre_expert_norm``. Gains are stored centred at 0.
* :class:`GainFirstRMSNorm` -- ``rms(x * (1 + w))``: the post-norms that carry a gain
  (``post_feedforward_layernorm``, ``post_expert_norm``): the gain is applied first, then a
  weightless rms.
* :class:`StoredGainRMSNorm` -- ``rms(x) * w``: the final ``model.norm``, whose weight is used
  as stored (no ``+ 1``).

The remaining norms (embedding, QK, attention output, post-attention) have no parameters and
use :func:`rms_norm` directly.
"""

from __future__ import annotations

import torch
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or as it is when it is already fp64 (a float64 model computes in float64
    throughout, as transformers' does)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over the last axis, computed and returned in fp32 (fp64 for fp64 input)."""
    x = upcast(x)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


class CenteredRMSNorm(nn.Module):
    """``rms(x) * (1 + weight)``; ``weight`` starts at 0 (effective gain 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps) * (1.0 + upcast(self.weight))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gain=1+w"


class GainFirstRMSNorm(nn.Module):
    """``rms(x * (1 + weight))``: gain first, then a weightless rms; ``weight`` starts at 0."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(upcast(x) * (1.0 + upcast(self.weight)), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gain=1+w applied before rms"


class StoredGainRMSNorm(nn.Module):
    """``rms(x) * weight`` with the weight used as stored; ``weight`` starts at 1."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps) * upcast(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gain=w as stored"
