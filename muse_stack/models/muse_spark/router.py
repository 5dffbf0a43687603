"""The Muse Spark router (checkpoint name ``mlp.gate``), always in fp32.

``logits = x Wr``; ``scores = sigmoid(logits * output_multiplier)``; the top-k experts are
chosen on ``scores + e_score_correction_bias`` (ties go to the lowest expert index); the
mixture weights are the chosen *unbiased* scores divided by ``(their sum + 1e-15)``, times
``routed_scaling_factor``. The correction bias only selects: it is a buffer, gets no
gradient, and a balancing rule may update it in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from muse_stack.models.muse_spark.norms import upcast
from muse_stack.models.muse_spark.config import ModelConfig


class Routing(NamedTuple):
    indices: torch.Tensor  #: [N, k] chosen experts, best first
    weights: torch.Tensor  #: [N, k] fp32 mixture weights
    scores: torch.Tensor  #: [N, E] fp32 unbiased sigmoid scores


class Fp32Module(nn.Module):
    """A module whose parameters and buffers stay at least fp32 through ``.to(dtype)``/``.bfloat16()``
    (fp64 stays fp64, as in transformers' float64 model)."""

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        for param in self.parameters(recurse=False):
            if param.is_floating_point() and param.dtype not in (torch.float32, torch.float64):
                param.data = param.data.float()
        for name, buf in list(self._buffers.items()):
            if buf is not None and buf.is_floating_point() and buf.dtype not in (torch.float32, torch.float64):
                self._buffers[name] = buf.float()
        return self


def select_top_k(selection_scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; equal values go to the lowest index."""
    return torch.sort(selection_scores, dim=-1, descending=True, stable=True).indices[..., :k]


class MuseSparkRouter(Fp32Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.output_multiplier = config.output_multiplier
        self.routed_scaling_factor = config.routed_scaling_factor
        self.eps = config.router_bias_eps
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_local_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        """Route tokens ``x`` [N, H]."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(upcast(x), upcast(self.weight).to(upcast(x).dtype))
        scores = torch.sigmoid(logits * self.output_multiplier)
        indices = select_top_k(scores.detach() + self.e_score_correction_bias, self.top_k)
        picked = scores.gather(-1, indices)
        weights = picked / (picked.sum(dim=-1, keepdim=True) + self.eps) * self.routed_scaling_factor
        return Routing(indices, weights, scores)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, fp32"
