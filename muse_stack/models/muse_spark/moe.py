"""Latent mixture of experts of Muse Spark (checkpoint name ``mlp``).

``h = rms(x Wpre) * (1 + pre_expert_norm)``; each picked expert computes
``[gate | up] = h Wgate_up`` (gate rows first), ``y = (silu(gate) * up) Wdown``, then the
post-expert norm ``rms(y * (1 + post_expert_norm))``; the mixture
``m = sum_k weight_k * y_k`` (accumulated in fp32) goes through ``post_expert_proj`` (Hm -> H).

Tokens are grouped per expert with one sort, so the loop runs over experts, not tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muse_stack.models.muse_spark.linear import Projection
from muse_stack.models.muse_spark.linear import linear
from muse_stack.models.muse_spark.norms import CenteredRMSNorm, GainFirstRMSNorm
from muse_stack.models.muse_spark.router import MuseSparkRouter
from muse_stack.models.muse_spark.config import ModelConfig


class MuseSparkExperts(nn.Module):
    """Stacked SwiGLU experts: ``gate_up_proj`` [E, 2I, Hm], ``down_proj`` [E, Hm, I]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, latent, inter = config.num_local_experts, config.moe_hidden_size, config.moe_intermediate_size
        self.num_experts = experts
        self.intermediate_size = inter
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, latent))
        self.down_proj = nn.Parameter(torch.empty(experts, latent, inter))
        self.post_expert_norm = GainFirstRMSNorm(latent, config.post_norm_eps)
        #: per-target expert adapters ("gate_up_proj", "down_proj"), set by muse_stack.models.muse_spark.peft
        self.adapters: nn.ModuleDict | None = None

    def project(self, name: str, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index``'s projection ``name`` (``gate_up_proj`` or ``down_proj``) of ``x``,
        plus its adapter's update when it has one."""
        out = linear(x, getattr(self, name)[index])
        if self.adapters is not None and name in self.adapters:
            out = out + self.adapters[name](index, x)
        return out

    def expert(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """Output of expert ``index`` on ``h`` [n, Hm], post-expert norm included (fp32)."""
        gate, up = self.project("gate_up_proj", index, h).split(self.intermediate_size, dim=-1)
        y = self.project("down_proj", index, F.silu(gate) * up)
        return self.post_expert_norm(y)

    def forward(self, h: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Mixture [N, Hm] (fp32) for ``h`` [N, Hm] routed by ``indices``/``weights`` [N, k]."""
        num_tokens, top_k = indices.shape
        flat_experts = indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // top_k
        weight_of = weights.reshape(-1)[order]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        mixture = torch.zeros(num_tokens, h.shape[-1], dtype=torch.promote_types(h.dtype, torch.float32),
                              device=h.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start:start + count]
            out = self.expert(expert, h.index_select(0, tokens))
            mixture.index_add_(0, tokens, out * weight_of[start:start + count, None])
            start += count
        return mixture

    def extra_repr(self) -> str:
        e, two_i, hm = self.gate_up_proj.shape
        return f"experts={e}, latent={hm}, intermediate={two_i // 2}, swiglu"


class MuseSparkMoE(nn.Module):
    """The layer's ``mlp``: router ``gate``, latent projections, experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = MuseSparkRouter(config)
        self.pre_expert_proj = Projection(config.hidden_size, config.moe_hidden_size)
        self.pre_expert_norm = CenteredRMSNorm(config.moe_hidden_size, config.rms_norm_eps)
        self.experts = MuseSparkExperts(config)
        self.post_expert_proj = Projection(config.moe_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, H] (normed input) -> FFN branch [B, T, H] before the post-FFN norm."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.gate(flat)
        h = self.pre_expert_norm(self.pre_expert_proj(flat))
        mixture = self.experts(h, routing.indices, routing.weights)
        return self.post_expert_proj(mixture).view(shape)
