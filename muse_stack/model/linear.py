"""Matmuls: in the autocast dtype when autocast is on, else in the weight's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (weight stored [out, in]); under autocast the inputs are cast by autocast."""
    if not torch.is_autocast_enabled(x.device.type):
        x = x.to(weight.dtype)
    return F.linear(x, weight)


class Projection(nn.Module):
    """A bias-free ``nn.Linear``-shaped projection whose matmul follows :func:`linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
