"""The Muse Spark text decoder and its causal-LM head.

Module tree (parameter names are the Hugging Face checkpoint names)::

    MuseSparkForCausalLM
      model: MuseSparkModel
        language_model: MuseSparkTextModel
          embed_tokens            [V, H]
          layers.{l}: MuseSparkDecoderLayer
            input_layernorm.weight                 [H]   rms(s) * (1 + w)
            self_attn.{q,k,v,gate,o}_proj.weight
            post_attention_residual_gate.gate      [H]
            pre_feedforward_layernorm.weight       [H]   rms(s) * (1 + w)
            mlp.gate.weight                        [E, H] fp32
            mlp.gate.e_score_correction_bias       [E]    fp32 buffer
            mlp.pre_expert_proj.weight             [Hm, H]
            mlp.pre_expert_norm.weight             [Hm]
            mlp.experts.gate_up_proj               [E, 2I, Hm]
            mlp.experts.down_proj                  [E, Hm, I]
            mlp.experts.post_expert_norm.weight    [Hm]
            mlp.post_expert_proj.weight            [H, Hm]
            post_feedforward_layernorm.weight      [H]   rms(x * (1 + w))
            post_feedforward_residual_gate.gate    [H]
          norm.weight             [H]   used as stored
        vision_tower, audio_tower, vision_adapter, vision_projection, perception_emb_norm
                                  only with ``towers`` (:mod:`muse_stack.models.muse_spark.perception`)
      lm_head.weight              [V, H]

The architecture notes name the norm modules (``input_layernorm``, ``pre_expert_norm``,
``post_expert_norm``, ...); their gains are stored as ``<module>.weight`` as in every Hugging
Face RMSNorm. The residual gates are stored as ``<module>.gate`` as the notes give them.

The residual stream is fp32; matmuls run in the autocast dtype (e.g. bf16) when autocast is
on, else in the weights' dtype.

With ``towers`` (a :class:`~muse_stack.models.muse_spark.tower_config.TowersConfig`) the model is transformers' whole
``MuseSparkForConditionalGeneration``: ``model`` also holds the perception towers and the
projector under transformers' names, and ``forward`` takes the media (``pixel_values``,
``pixel_values_videos``, ``input_values`` with their grids and mask). The text embeddings are
those of the ids with every media placeholder replaced by 0, the media features replace the
placeholders' rows (:func:`muse_stack.models.muse_spark.perception.scatter_media`), and the decoder runs on
that stream with ordinary 1-D positions and the causal mask, as transformers does. Without
``towers`` nothing of this exists and the text model is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.attention import MuseSparkAttention
from muse_stack.models.muse_spark.init import init_weights
from muse_stack.models.muse_spark.linear import Projection
from muse_stack.models.muse_spark.loss import LossResult, causal_lm_loss
from muse_stack.models.muse_spark.moe import MuseSparkMoE
from muse_stack.models.muse_spark.norms import CenteredRMSNorm, GainFirstRMSNorm, StoredGainRMSNorm, rms_norm, upcast
from muse_stack.models.muse_spark.packing import (
    CuSeqlens,
    attention_mask,
    position_ids_from_segments,
    run_ids,
    segment_ids_from_cu_seqlens,
)
from muse_stack.models.muse_spark.residual import GatedResidual
from muse_stack.models.muse_spark.rope import rope_cos_sin
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.models.muse_spark.tower_config import TowersConfig


class MuseSparkDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.post_norm_eps = config.post_norm_eps
        self.input_layernorm = CenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MuseSparkAttention(config, layer_idx)
        self.post_attention_residual_gate = GatedResidual(config.hidden_size, config.residual_gate_temperature)
        self.pre_feedforward_layernorm = CenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MuseSparkMoE(config)
        self.post_feedforward_layernorm = GainFirstRMSNorm(config.hidden_size, config.post_norm_eps)
        self.post_feedforward_residual_gate = GatedResidual(config.hidden_size, config.residual_gate_temperature)

    def forward(self, stream: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """One layer on the fp32 residual stream [B, T, H]; returns the new stream."""
        attn = self.self_attn(self.input_layernorm(stream), cos=cos, sin=sin, mask=mask)
        stream = self.post_attention_residual_gate(stream, rms_norm(attn, self.post_norm_eps))
        ffn = self.mlp(self.pre_feedforward_layernorm(stream))
        return self.post_feedforward_residual_gate(stream, self.post_feedforward_layernorm(ffn))


@dataclass
class PackedLayout:
    """Positions and masks shared by all layers of one forward pass."""

    cos: torch.Tensor
    sin: torch.Tensor
    sliding_mask: torch.Tensor | None
    full_mask: torch.Tensor | None


class MuseSparkTextModel(nn.Module):
    """``model.language_model``: embedding, decoder layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # pad_token_id is the embedding's padding_idx, as in transformers: that row gets no gradient
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(MuseSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = StoredGainRMSNorm(config.hidden_size, config.rms_norm_eps)

    def layout(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
               segment_ids: torch.Tensor | None = None, cu_seqlens: CuSeqlens | None = None) -> PackedLayout:
        batch, seq_len = input_ids.shape
        device = input_ids.device
        if cu_seqlens is not None and segment_ids is None:
            segment_ids = segment_ids_from_cu_seqlens(cu_seqlens, batch, seq_len, device)
        runs = run_ids(segment_ids.to(device)) if segment_ids is not None else None
        if position_ids is None:
            if runs is not None:
                position_ids = position_ids_from_segments(runs)
            else:
                position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
        position_ids = position_ids.to(device).expand(batch, seq_len)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        need_sliding = any(not self.config.is_full_attention(i) for i in range(self.config.num_hidden_layers))
        sliding = attention_mask(seq_len, window=self.config.sliding_window, runs=runs, device=device) \
            if need_sliding else None
        full = attention_mask(seq_len, window=None, runs=runs, device=device)
        return PackedLayout(cos, sin, sliding, full)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup and its parameter-free norm: the fp32 residual stream."""
        return rms_norm(self.embed_tokens(input_ids), self.config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, cu_seqlens: CuSeqlens | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, H] (fp32).

        ``inputs_embeds`` [B, T, H]: the residual stream to start from instead of
        :meth:`embed` of ``input_ids`` (the text embeddings with media scattered in); ``input_ids``
        still gives the batch and sequence shape of the layout."""
        layout = self.layout(input_ids, position_ids=position_ids, segment_ids=segment_ids, cu_seqlens=cu_seqlens)
        if inputs_embeds is None:
            stream = self.embed(input_ids)
        else:
            if tuple(inputs_embeds.shape) != (*input_ids.shape, self.config.hidden_size):
                raise InputError("must be [batch, tokens, hidden_size] matching input_ids", field="inputs_embeds",
                                 value=tuple(inputs_embeds.shape),
                                 fix=f"pass {(*input_ids.shape, self.config.hidden_size)}")
            stream = upcast(inputs_embeds)
        for layer in self.layers:
            mask = layout.full_mask if layer.self_attn.window is None else layout.sliding_mask
            stream = layer(stream, cos=layout.cos, sin=layout.sin, mask=mask)
        return self.norm(stream)


class MuseSparkModel(nn.Module):
    """``model``: holds the text decoder under ``language_model`` and, with ``towers``, the
    perception towers and the projector beside it (transformers' names:
    :data:`muse_stack.models.muse_spark.perception.PERCEPTION_MODULES`)."""

    def __init__(self, config: ModelConfig, towers: TowersConfig | None = None) -> None:
        super().__init__()
        self.language_model = MuseSparkTextModel(config)
        self.towers_config = towers
        if towers is not None:
            from muse_stack.models.muse_spark.perception import add_perception_modules

            add_perception_modules(self, towers, text_hidden_size=config.hidden_size,
                                   text_rms_norm_eps=config.rms_norm_eps)

    def embed_multimodal(self, input_ids: torch.Tensor, *, pixel_values: torch.Tensor | None = None,
                         image_grid_thw: torch.Tensor | None = None,
                         pixel_values_videos: torch.Tensor | None = None,
                         video_grid_thw: torch.Tensor | None = None, input_values: torch.Tensor | None = None,
                         input_values_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream [B, T, H] the decoder starts from: the normed embeddings of the ids
        with every media placeholder replaced by 0, each medium's features in its placeholders.

        Placeholders of a medium whose inputs are not given are refused (they would stay the
        embedding of id 0), as is a medium given without its grid."""
        from muse_stack.models.muse_spark.perception import embed_media, text_input_ids

        towers = self.towers_config
        if towers is None:
            raise InputError("the model has no perception towers", field="towers", value=None,
                             fix="build it with towers=TowersConfig(...) or load_checkpoint(..., towers=True)")
        stream = self.language_model.embed(text_input_ids(input_ids, towers))
        return embed_media(self, towers, input_ids, stream, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                           pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                           input_values=input_values, input_values_mask=input_values_mask)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  #: [B, T, V] fp32, soft-capped
    loss: torch.Tensor | None = None  #: mean cross entropy over supervised tokens
    num_tokens: torch.Tensor | None = None  #: supervised token count


class MuseSparkForCausalLM(nn.Module):
    """The Muse Spark text decoder with its LM head; with ``towers``, also the perception towers
    and the projector (transformers' whole ``MuseSparkForConditionalGeneration``).

    ``MuseSparkForCausalLM(config, seed=0)`` initialises deterministically (see
    :func:`muse_stack.models.muse_spark.init.init_weights`; the towers by
    :func:`muse_stack.models.muse_spark.perception.init_perception_weights` from the same seed, each tensor
    from a generator seeded by its state-dict name); on the meta device nothing is initialised.
    """

    def __init__(self, config: ModelConfig, *, seed: int | None = 0, towers: TowersConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = MuseSparkModel(config, towers)
        self.lm_head = Projection(config.hidden_size, config.vocab_size)
        if seed is not None:
            init_weights(self, seed, std=config.initializer_range)
            if towers is not None:
                from muse_stack.models.muse_spark.perception import init_perception_weights

                init_perception_weights(self.model, seed, std=config.initializer_range, prefix="model.")

    @property
    def towers_config(self) -> TowersConfig | None:
        """The perception towers' config, or None for the text decoder alone."""
        return self.model.towers_config

    @property
    def language_model(self) -> MuseSparkTextModel:
        return self.model.language_model

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Soft-capped logits: ``softcap * tanh(hidden Wlm * output_multiplier / softcap)`` (fp32)."""
        cap = self.config.final_logit_softcapping
        raw = upcast(self.lm_head(hidden))
        return cap * torch.tanh(raw * (self.config.output_multiplier / cap))

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, cu_seqlens: CuSeqlens | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                input_values: torch.Tensor | None = None, input_values_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """Logits for ``input_ids`` [B, T]; with ``labels`` also the loss.

        ``labels[b, t]`` is the target of position t, i.e. the *next* token ``input_ids[b, t+1]``
        (see :func:`muse_stack.models.muse_spark.loss.shift_labels`); ``loss_mask[b, t]`` marks supervised
        targets. Packed rows: pass ``cu_seqlens`` or ``segment_ids`` (and optionally
        ``position_ids``) -- see :mod:`muse_stack.models.muse_spark.packing`.

        Media (a model with towers only), as transformers' processors make them:
        ``pixel_values`` [patches, patch_dim] with ``image_grid_thw`` [images, 3],
        ``pixel_values_videos`` with ``video_grid_thw``, ``input_values`` [clips, samples] with
        ``input_values_mask``; their features replace the placeholder ids in ``input_ids``.
        """
        media = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
                 "pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw,
                 "input_values": input_values, "input_values_mask": input_values_mask}
        if self.towers_config is None:
            passed = [name for name, value in media.items() if value is not None]
            if passed:
                raise InputError("media inputs given to a text-only model (it has no perception towers)",
                                 field=passed[0], value="given",
                                 fix="build the model with towers=TowersConfig(...) or load_checkpoint(..., "
                                     "towers=True), or leave the media out")
            hidden = self.language_model(input_ids, position_ids=position_ids, segment_ids=segment_ids,
                                         cu_seqlens=cu_seqlens)
        else:
            hidden = self.language_model(input_ids, position_ids=position_ids, segment_ids=segment_ids,
                                         cu_seqlens=cu_seqlens,
                                         inputs_embeds=self.model.embed_multimodal(input_ids, **media))
        logits = self.logits_from_hidden(hidden)
        if labels is None:
            return CausalLMOutput(logits)
        result: LossResult = causal_lm_loss(logits, labels, loss_mask)
        return CausalLMOutput(logits, result.loss, result.num_tokens)
