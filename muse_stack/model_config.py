"""The one model-config type: every architecture fact of Muse Spark Open in one place.

Defaults are the real 816B-A42B model. Proxies override only what differs. Field names
are the keys of the checkpoint's ``config.json`` (under ``text_config`` when present), so
``ModelConfig.from_hf_config`` reads a real checkpoint and ``to_hf_config`` writes one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from muse_stack.errors import InputError, RecipeError

LayerType = Literal["sliding_attention", "full_attention"]

#: Period and offset of the full-attention layers in the real model: layer l is full
#: attention when l % 4 == 1 (S F S S repeating).
FULL_ATTENTION_PERIOD = 4
FULL_ATTENTION_OFFSET = 1


def default_layer_types(num_layers: int) -> list[LayerType]:
    return [
        "full_attention" if layer % FULL_ATTENTION_PERIOD == FULL_ATTENTION_OFFSET else "sliding_attention"
        for layer in range(num_layers)
    ]


class ModelConfig(BaseModel):
    """Shapes and numerics of the Muse Spark text decoder."""

    # finite floats; sizes bounded far above the real model so that no loop or allocation runs away
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    vocab_size: int = Field(202048, gt=0, le=1 << 24)
    #: ids at or above this are untrained padding rows of the vocabulary
    first_padding_token_id: int | None = 201818
    hidden_size: int = Field(8192, gt=0, le=1 << 17)
    num_hidden_layers: int = Field(62, gt=0, le=4096)
    num_attention_heads: int = Field(128, gt=0, le=1 << 14)
    num_key_value_heads: int = Field(16, gt=0, le=1 << 14)
    head_dim: int = Field(64, gt=0, le=1 << 14)
    layer_types: list[LayerType] | None = Field(
        None, description="per-layer attention type; None = the model's pattern (full when l % 4 == 1)"
    )
    sliding_window: int = Field(2048, gt=0, le=1 << 26, description="keys per query on sliding layers, counting the query")
    rope_theta: float = Field(5.0e5, gt=0)
    qk_scale_factor: float = 5.4730064863875
    moe_hidden_size: int = Field(4096, gt=0, le=1 << 17, description="latent width Hm the experts work in")
    num_local_experts: int = Field(256, gt=0, le=1 << 16)
    num_experts_per_tok: int = Field(8, gt=0, le=1 << 16)
    moe_intermediate_size: int = Field(4096, gt=0, le=1 << 18, description="expert FFN width I")
    num_shared_experts: int = Field(0, ge=0)
    routed_scaling_factor: float = 1.0
    output_multiplier: float = Field(2.0**-2.5, description="applied to router logits and to output logits")
    final_logit_softcapping: float = Field(20.0, gt=0)
    residual_gate_temperature: float = Field(0.3, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    post_norm_eps: float = Field(1e-8, gt=0)
    router_bias_eps: float = Field(1e-15, gt=0, description="added to the sum of picked scores")
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: Literal["silu"] = "silu"
    bos_token_id: int = 200000
    eos_token_id: list[int] = Field(default_factory=lambda: [200001, 200008])
    pad_token_id: int = 200018
    max_position_embeddings: int | None = None

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts ({self.num_local_experts})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotate-half RoPE")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be false: Muse Spark's input and output embeddings are untied")
        if self.attention_bias:
            raise ValueError("attention_bias must be false: Muse Spark attention has no bias")
        if self.num_shared_experts:
            raise ValueError("num_shared_experts must be 0: Muse Spark has no shared expert")
        return self

    # ---- layer pattern -------------------------------------------------------------
    @property
    def resolved_layer_types(self) -> list[LayerType]:
        return list(self.layer_types) if self.layer_types is not None else default_layer_types(self.num_hidden_layers)

    def is_full_attention(self, layer: int) -> bool:
        return self.resolved_layer_types[layer] == "full_attention"

    def uses_rope(self, layer: int) -> bool:
        """RoPE on sliding layers only; full-attention layers are NoPE."""
        return not self.is_full_attention(layer)

    @property
    def softmax_scale(self) -> float:
        return self.qk_scale_factor / self.head_dim**0.5

    # ---- parameter counts ----------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """q, k, v, output-gate and o projections of one layer."""
        h, qd, kvd = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return h * qd + 2 * h * kvd + h * qd + qd * h

    @property
    def latent_projection_params(self) -> int:
        return 2 * self.hidden_size * self.moe_hidden_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_local_experts

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert: gate_up [2I, Hm] and down [Hm, I]."""
        return 3 * self.moe_hidden_size * self.moe_intermediate_size

    @property
    def norm_params_per_layer(self) -> int:
        # input, pre-feedforward, post-feedforward gains (H each), two residual gates (H each),
        # pre-expert and post-expert gains (Hm each)
        return 5 * self.hidden_size + 2 * self.moe_hidden_size

    @property
    def dense_params_per_layer(self) -> int:
        """Weights of one layer that every token uses (all but the routed experts)."""
        return self.attention_params + self.latent_projection_params + self.router_params

    @property
    def active_params_per_layer(self) -> int:
        return self.dense_params_per_layer + self.num_experts_per_tok * self.expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def output_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def active_params(self) -> int:
        """Matmul weights one token uses: the count MFU is defined with (norm gains and the
        embedding lookup are not counted). 44,432,883,712 for the real model."""
        return self.num_hidden_layers * self.active_params_per_layer + self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        per_layer = self.dense_params_per_layer + self.num_local_experts * self.expert_params + self.norm_params_per_layer
        return self.num_hidden_layers * per_layer + self.embedding_params + self.output_params + self.hidden_size

    # ---- checkpoint config.json ----------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> "ModelConfig":
        """Read a checkpoint's config.json (a path or its parsed dict)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise InputError(
                    "config.json not found",
                    field="model.config_path",
                    value=str(path),
                    fix="point it at a checkpoint directory that holds config.json, or at the file itself",
                )
            from muse_stack.safeio import read_json

            config = read_json(path, field="model.config_path", what="config.json",
                               fix="restore the checkpoint's config.json (a JSON object)")
        text = config.get("text_config") or config
        if not isinstance(text, dict):
            raise InputError("config.json's text_config is not an object", field="model.config_path",
                             value=type(text).__name__, fix="restore the checkpoint's config.json")
        text = dict(text)
        known = set(cls.model_fields)
        values: dict[str, Any] = {}
        for key, value in text.items():
            if key in known:
                values[key] = value
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if "rope_theta" not in values and isinstance(rope, dict) and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if values.get("layer_types") is not None and "num_hidden_layers" in values \
                and list(values["layer_types"]) == default_layer_types(values["num_hidden_layers"]):
            values["layer_types"] = None  # the model's own pattern
        if isinstance(values.get("eos_token_id"), int):
            values["eos_token_id"] = [values["eos_token_id"]]
        for key in ("mlp_layer_types",):
            kinds = text.get(key)
            if kinds is not None and any(kind != "sparse" for kind in kinds):
                raise RecipeError(
                    "every Muse Spark layer is MoE; a dense layer is not supported",
                    field=f"config.json {key}", value=kinds, fix="use a Muse Spark checkpoint")
        try:
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise RecipeError(f"config.json does not describe a valid Muse Spark model: {exc}",
                              field="model", value=None, fix="check the checkpoint's config.json") from exc

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json (flat, the keys from_hf_config reads back)."""
        data = self.model_dump()
        data["layer_types"] = self.resolved_layer_types
        data["mlp_layer_types"] = ["sparse"] * self.num_hidden_layers
        data["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        data["layer_rope_theta"] = [self.rope_theta if self.uses_rope(i) else 0 for i in range(self.num_hidden_layers)]
        data["model_type"] = "muse_spark"
        data["architectures"] = ["MuseSparkForCausalLM"]
        return data

    def with_overrides(self, **overrides: Any) -> "ModelConfig":
        return type(self)(**{**self.model_dump(exclude_unset=False), **overrides})


#: The real model (816B-A42B).
MUSE_SPARK_OPEN = ModelConfig()
