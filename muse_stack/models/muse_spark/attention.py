"""Muse Spark self-attention: GQA, weightless QK norm, RoPE on sliding layers only (NoPE on
full-attention layers), scale ``qk_scale_factor / sqrt(head_dim)``, and the output gate
``o = rms(o) * sigmoid(g)`` before ``o_proj``.

The attention itself is :func:`torch.nn.functional.scaled_dot_product_attention` with a
boolean mask (sliding window and/or packed-sequence boundaries) or ``is_causal``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muse_stack.models.muse_spark.linear import Projection
from muse_stack.models.muse_spark.norms import rms_norm, upcast
from muse_stack.models.muse_spark.rope import apply_rope
from muse_stack.models.muse_spark.config import ModelConfig


class MuseSparkAttention(nn.Module):
    """``self_attn`` of one decoder layer (q/k/v/gate/o projections)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.is_sliding = not config.is_full_attention(layer_idx)
        self.use_rope = config.uses_rope(layer_idx)
        self.window = config.sliding_window if self.is_sliding else None
        self.scale = config.softmax_scale
        self.eps = config.rms_norm_eps
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Projection(hidden, q_dim)
        self.k_proj = Projection(hidden, kv_dim)
        self.v_proj = Projection(hidden, kv_dim)
        self.gate_proj = Projection(hidden, q_dim)
        self.o_proj = Projection(q_dim, hidden)

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, T, H] (normed input); ``mask`` boolean [B|1, 1, T, T] or None (causal).

        Returns the branch output [B, T, H] before the post-attention norm.
        """
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        g = self.gate_proj(x).view(batch, seq_len, self.num_heads, self.head_dim)
        q = rms_norm(q, self.eps)
        k = rms_norm(k, self.eps)
        if self.use_rope:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        compute_dtype = v.dtype
        o = F.scaled_dot_product_attention(
            q.to(compute_dtype), k.to(compute_dtype), v,
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        o = o.transpose(1, 2)  # [B, T, heads, head_dim]
        o = rms_norm(o, self.eps) * torch.sigmoid(upcast(g))
        return self.o_proj(o.reshape(batch, seq_len, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        kind = f"sliding window={self.window}, rope" if self.is_sliding else "full, nope"
        return f"layer={self.layer_idx}, {kind}, heads={self.num_heads}, kv_heads={self.num_kv_heads}"
