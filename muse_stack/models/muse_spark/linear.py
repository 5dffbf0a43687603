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


class Projection(nn.Linear):
    """A bias-free ``nn.Linear`` whose matmul follows :func:`linear`.

    It is an ``nn.Linear`` (same ``weight`` [out, in], ``bias`` None) so that libraries that
    adapt linear layers, such as Hugging Face ``peft``, recognise it. ``adapter`` (None unless
    :func:`muse_stack.models.muse_spark.peft.apply_peft` sets one) adds a LoRA or DoRA update to the output.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        nn.Module.__init__(self)  # no nn.Linear init: the weights are initialised by init_weights or loaded
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", None)
        self.adapter: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        if self.adapter is not None:
            return self.adapter(x, out, self.weight)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"
