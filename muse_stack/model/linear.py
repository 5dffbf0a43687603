"""Matmul helper: run in the autocast dtype when autocast is on, else in the weight's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (weight stored [out, in]); under autocast the inputs are cast by autocast."""
    if not torch.is_autocast_enabled(x.device.type):
        x = x.to(weight.dtype)
    return F.linear(x, weight)

