"""Rotary position embedding, rotate-half layout (pairs ``(j, j + d/2)``), in fp32."""

from __future__ import annotations

import torch

from muse_stack.models.muse_spark.norms import upcast


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[B, T, head_dim]`` for integer ``position_ids`` ``[B, T]``.

    Inverse frequency of pair j is ``theta ** (-2j / head_dim)``.
    """
    # in fp32, as transformers' MuseSparkTextRotaryEmbedding and megatron-core's RotaryEmbedding form it
    exponents = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = position_ids.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by cos/sin ``[B, T, head_dim]`` (fp32 result)."""
    cos = cos[:, None]
    sin = sin[:, None]
    x = upcast(x)
    return x * cos + rotate_half(x) * sin
