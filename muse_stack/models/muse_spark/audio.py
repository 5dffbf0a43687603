"""Muse Spark's audio tower (transformers' ``MuseSparkAudioModel``), written from the math.

A causal convolution pyramid over the raw 24 kHz mono waveform: no spectrogram, no attention.
Module tree (parameter names are transformers', relative to ``model.audio_tower``)::

    MuseSparkAudioModel
      layers.{s}.patch_embedder.proj.{weight,bias}   [C_s, C_{s-1} * p_s], [C_s]   (C_{-1} = 1)
      layers.{s}.patch_embedder.norm.weight          [C_s]          RMSNorm, gain as stored
      layers.{s}.conv_blocks.{b}.conv.{weight,bias}  [C_s, 1, K], [C_s]   depthwise, causal
      layers.{s}.conv_blocks.{b}.norm.weight         [C_s]
      layers.{s}.conv_blocks.{b}.mlp.fc1.{weight,bias}  [r C_s, C_s]
      layers.{s}.conv_blocks.{b}.mlp.fc2.{weight,bias}  [C_s, r C_s]
      norm.weight                                    [C_last]
      proj.{weight,bias}                             [out, C_last]
      post_proj_norm.weight                          [out]

Stage s: merge p_s consecutive frames (their C_{s-1} channels side by side, frame-major) into one
by ``proj``, then ``norm``; then ConvBlocks ``x += mlp(norm(dwconv(x)))``, where ``dwconv`` is a
depthwise Conv1d of kernel K that sees the current and the K-1 previous frames (K-1 zeros on
the left, none on the right). After the stages: ``post_proj_norm(proj(norm(x)))``. One output
token per prod(p_s) samples (1920 = 80 ms).

RMSNorm here is ``x / sqrt(mean(x^2) + eps) * w``. Numerics: fp32, or float64 with float64
weights; matmuls in the weights' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muse_stack.models.muse_spark.norms import rms_norm
from muse_stack.models.muse_spark.vision import dense, wide_dtype
from muse_stack.models.muse_spark.tower_config import AudioConfig


class RMSNorm(nn.Module):
    """``rms(x) * weight``, weight as stored (starts at 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.eps)
        return y * self.weight.to(y.dtype)


class CausalDepthwiseConv1d(nn.Conv1d):
    """Depthwise Conv1d over [B, C, T] with ``pad = (K - 1, 0)``: output t sees inputs t-K+1..t."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=True)
        #: zeros added (left, right) of the time axis; (K - 1, 0) is causal
        self.pad = (kernel_size - 1, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(F.pad(x, self.pad), self.weight.to(x.dtype), self.bias.to(x.dtype), groups=self.groups)


class MuseSparkAudioPatchEmbedding(nn.Module):
    def __init__(self, config: AudioConfig, stage: int) -> None:
        super().__init__()
        in_channels = 1 if stage == 0 else config.hidden_sizes[stage - 1]
        self.patch_size = config.patch_sizes[stage]
        self.proj = nn.Linear(in_channels * self.patch_size, config.hidden_sizes[stage])
        self.norm = RMSNorm(config.hidden_sizes[stage], config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, frames, channels = x.shape
        x = x.reshape(batch, frames // self.patch_size, self.patch_size * channels)
        return self.norm(dense(self.proj, x))


class MuseSparkAudioMLP(nn.Module):
    def __init__(self, config: AudioConfig, stage: int) -> None:
        super().__init__()
        width = config.hidden_sizes[stage]
        self.fc1 = nn.Linear(width, config.intermediate_size(stage))
        self.fc2 = nn.Linear(config.intermediate_size(stage), width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(self.fc2, F.gelu(dense(self.fc1, x).to(x.dtype))).to(x.dtype)


class MuseSparkAudioConvBlock(nn.Module):
    def __init__(self, config: AudioConfig, stage: int) -> None:
        super().__init__()
        width = config.hidden_sizes[stage]
        self.conv = CausalDepthwiseConv1d(width, config.conv_kernel_size)
        self.norm = RMSNorm(width, config.rms_norm_eps)
        self.mlp = MuseSparkAudioMLP(config, stage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, C] -> [B, T, C]."""
        mixed = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(self.norm(mixed))


class MuseSparkAudioLayer(nn.Module):
    def __init__(self, config: AudioConfig, stage: int) -> None:
        super().__init__()
        self.patch_embedder = MuseSparkAudioPatchEmbedding(config, stage)
        self.conv_blocks = nn.ModuleList(MuseSparkAudioConvBlock(config, stage) for _ in range(config.depths[stage]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedder(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


class MuseSparkAudioModel(nn.Module):
    """``model.audio_tower``."""

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MuseSparkAudioLayer(config, s) for s in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_sizes[-1], config.rms_norm_eps)
        self.proj = nn.Linear(config.hidden_sizes[-1], config.out_hidden_size)
        self.post_proj_norm = RMSNorm(config.out_hidden_size, config.rms_norm_eps)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        """``input_values`` [B, S] (S a multiple of ``samples_per_token``) -> [B, S / samples_per_token, out]."""
        from muse_stack.util.errors import InputError

        step = self.config.samples_per_token
        if input_values.ndim != 2 or input_values.shape[1] % step:
            raise InputError(f"must be [batch, samples] with samples a multiple of {step} (one token per {step} "
                             "samples)", field="input_values", value=tuple(input_values.shape),
                             fix="pad the waveform on the right with the feature extractor (MuseSparkFeatureExtractor)")
        x = input_values[..., None].to(wide_dtype(self.proj.weight.dtype))
        for layer in self.layers:
            x = layer(x)
        return self.post_proj_norm(dense(self.proj, self.norm(x)))
