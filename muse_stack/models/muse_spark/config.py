"""The one model-config type: every architecture fact of Muse Spark Open in one place.

Defaults are the real 816B-A42B model. Proxies override only what differs. Field names
are the keys of the checkpoint's ``config.json`` (under ``text_config`` when present), so
``ModelConfig.from_hf_config`` reads a real checkpoint's and ``to_hf_text_config`` writes its
``text_config`` (:mod:`muse_stack.models.muse_spark.hf_config` writes the whole config.json).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from muse_stack.util.errors import InputError, RecipeError

LayerType = Literal["sliding_attention", "full_attention"]

#: Period of the full-attention (and NoPE) layers. As transformers' ``MuseSparkTextConfig``
#: defines it (configuration_muse_spark.py, ``__post_init__``), layer l is full attention, and
#: NoPE, when ``(L - 1 - l) % 4 == 0``: every 4th layer counted back from the last. For the real
#: 62 layers that is l % 4 == 1 (S F S S repeating).
FULL_ATTENTION_PERIOD = 4
#: the router's renormalisation epsilon, fixed in transformers' ``MuseSparkTopkRouter``
ROUTER_RENORM_EPS = 1e-15


def _counted_back_full(num_layers: int, layer: int) -> bool:
    return (num_layers - 1 - layer) % FULL_ATTENTION_PERIOD == 0


def default_layer_types(num_layers: int) -> list[LayerType]:
    """transformers' ``layer_types`` when a config leaves it out."""
    return ["full_attention" if _counted_back_full(num_layers, layer) else "sliding_attention"
            for layer in range(num_layers)]


def default_layer_rope_theta(num_layers: int, rope_theta: float) -> list[float]:
    """transformers' ``layer_rope_theta`` when a config leaves it out: 0 (NoPE) on every 4th
    layer counted back from the last, the global theta elsewhere. It does not follow
    ``layer_types``."""
    return [0 if _counted_back_full(num_layers, layer) else rope_theta for layer in range(num_layers)]


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
        None, description="per-layer attention type; None = transformers' pattern (full on every 4th layer "
                          "counted back from the last)"
    )
    layer_rope_theta: list[float] | None = Field(
        None, description="per-layer RoPE base, 0 = NoPE (transformers' field); None = transformers' default "
                          "(NoPE on every 4th layer counted back from the last, rope_theta elsewhere). A non-zero "
                          "entry must equal rope_theta: transformers applies the global theta to every RoPE layer")
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
    router_bias_eps: float = Field(ROUTER_RENORM_EPS, gt=0,
                                   description="added to the sum of picked scores (fixed at 1e-15 in transformers)")
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: Literal["silu"] = "silu"
    attention_dropout: float = Field(0.0, ge=0.0, le=0.0, description="transformers' attention dropout; only 0 "
                                     "is supported (neither engine drops attention probabilities)")
    initializer_range: float = Field(0.02, gt=0, description="std of the normal initialisation of the "
                                     "projections, experts, router, embedding and LM head")
    intermediate_size: int = Field(16384, gt=0, le=1 << 18, description="width of a dense MLP layer; every "
                                   "Muse Spark layer is MoE, so it shapes no tensor (kept for the config's round trip)")
    # ids and limits as transformers defines and defaults them; none changes the computation
    bos_token_id: int | None = 200000
    eos_token_id: int | list[int] | None = 200001
    pad_token_id: int | None = None
    max_position_embeddings: int = Field(1048576, gt=0)

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
        if self.router_bias_eps != ROUTER_RENORM_EPS:
            raise ValueError(f"router_bias_eps must be {ROUTER_RENORM_EPS}: transformers' router fixes its "
                             "renormalisation epsilon there, so another value would be read differently")
        thetas = self.layer_rope_theta
        if thetas is not None:
            if len(thetas) != self.num_hidden_layers:
                raise ValueError(f"layer_rope_theta has {len(thetas)} entries but num_hidden_layers is "
                                 f"{self.num_hidden_layers}")
            odd = [i for i, t in enumerate(thetas) if t != 0 and t != self.rope_theta]
            if odd:
                raise ValueError(
                    f"layer_rope_theta[{odd[0]}] is {thetas[odd[0]]} but rope_theta is {self.rope_theta}: "
                    "transformers applies the global rope_theta to every layer whose entry is not 0, so a "
                    "per-layer base would be read differently; use 0 (NoPE) or rope_theta")
        return self

    # ---- layer pattern -------------------------------------------------------------
    @property
    def resolved_layer_types(self) -> list[LayerType]:
        return list(self.layer_types) if self.layer_types is not None else default_layer_types(self.num_hidden_layers)

    def is_full_attention(self, layer: int) -> bool:
        return self.resolved_layer_types[layer] == "full_attention"

    @property
    def resolved_layer_rope_theta(self) -> list[float]:
        if self.layer_rope_theta is not None:
            return list(self.layer_rope_theta)
        return default_layer_rope_theta(self.num_hidden_layers, self.rope_theta)

    def uses_rope(self, layer: int) -> bool:
        """RoPE where ``layer_rope_theta`` is not 0, as transformers decides it (NoPE elsewhere)."""
        return self.resolved_layer_rope_theta[layer] != 0

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
        """Read a checkpoint's config.json (a path or its parsed dict): transformers' nested
        ``muse_spark`` layout (the text keys under ``text_config``), or a flat text config.

        Every key means what transformers means by it (:data:`TEXT_FIELDS`); a value muse-stack
        cannot compute the same way is refused, naming the key."""
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
            from muse_stack.util.safeio import read_json

            config = read_json(path, field="model.config_path", what="config.json",
                               fix="restore the checkpoint's config.json (a JSON object)")
        try:
            return cls(**text_values(config))
        except ValidationError as exc:  # name the key a field's check refused, with its value
            first = exc.errors()[0]
            key = ".".join(str(part) for part in first["loc"])
            raise RecipeError(f"config.json does not describe a valid Muse Spark model: {exc}",
                              field=f"config.json text_config.{key}" if key else "config.json text_config",
                              value=first.get("input") if key else None,
                              fix="check the checkpoint's config.json") from exc
        except (ValueError, TypeError) as exc:
            raise RecipeError(f"config.json does not describe a valid Muse Spark model: {exc}",
                              field="model", value=None, fix="check the checkpoint's config.json") from exc

    def to_hf_text_config(self) -> dict[str, Any]:
        """``text_config`` of transformers' layout (``model_type: muse_spark_text``)."""
        return text_config(self)

    def with_overrides(self, **overrides: Any) -> "ModelConfig":
        return type(self)(**{**self.model_dump(exclude_unset=False), **overrides})


#: The real model (816B-A42B).
MUSE_SPARK_OPEN = ModelConfig()


# ---- transformers' text_config -------------------------------------------------------
TOP_MODEL_TYPE = "muse_spark"
TEXT_MODEL_TYPE = "muse_spark_text"

#: every field of transformers' MuseSparkTextConfig (and its PreTrainedConfig base) -> how it is read
TEXT_FIELDS: dict[str, str] = {
    # same name, same meaning (muse_stack.models.muse_spark.config.ModelConfig)
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "initializer_range", "rms_norm_eps",
         "pad_token_id", "eos_token_id", "bos_token_id", "attention_bias",
         "attention_dropout", "sliding_window", "layer_types", "final_logit_softcapping", "qk_scale_factor",
         "output_multiplier", "post_norm_eps", "layer_rope_theta", "hidden_act", "moe_intermediate_size",
         "num_local_experts", "num_experts_per_tok", "routed_scaling_factor", "moe_hidden_size",
         "residual_gate_temperature"), "field"),
    "rope_parameters": "rope_theta, with rope_type 'default' (no other RoPE scaling is implemented); a "
                       "non-empty rope_scaling replaces it, as transformers reads them",
    "tie_word_embeddings": "read and kept false: transformers' muse_spark declares no tied weights, so true "
                           "ties nothing (the input and output embeddings stay two tensors)",
    "mlp_layer_types": "every entry 'sparse' (a dense layer is refused)",
    # change nothing the model computes
    **dict.fromkeys(
        ("use_cache", "output_router_logits", "transformers_version", "architectures", "output_hidden_states",
         "return_dict", "dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
         "problem_type"), "runtime"),
}
#: muse-stack's own keys written into text_config (transformers keeps and ignores them)
OWN_FIELDS = ("first_padding_token_id",)


def _refuse(key: str, value: Any, why: str, fix: str) -> RecipeError:
    return RecipeError(why, field=f"config.json text_config.{key}", value=value, fix=fix)


#: the RoPE a MuseSparkTextConfig gets when its config names none (its ``__post_init__``)
TRANSFORMERS_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 500_000.0}
#: the base transformers fills into a RoPE dict that names none (``RotaryEmbeddingConfigMixin.default_theta``)
TRANSFORMERS_FALLBACK_THETA = 10_000.0


def rope_theta_as_transformers_reads(text: dict[str, Any]) -> float:
    """The decoder's RoPE base from a text config, as transformers 5.24 resolves it
    (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` after ``MuseSparkTextConfig.__post_init__``):

    * a non-empty ``rope_scaling`` replaces ``rope_parameters`` (``rope_scaling or rope_parameters``);
    * with neither, the model's default RoPE (theta 500000); a legacy top-level ``rope_theta`` is
      then ignored;
    * a RoPE dict without ``rope_theta`` takes the legacy top-level ``rope_theta``, else 10000.

    Only ``rope_type`` 'default' is implemented; another is refused naming the key it came from."""
    scaling = text.get("rope_scaling")
    if scaling:
        key, rope = "rope_scaling", scaling
    elif text.get("rope_parameters") is not None:
        key, rope = "rope_parameters", text["rope_parameters"]
    else:
        return TRANSFORMERS_DEFAULT_ROPE["rope_theta"]
    if not isinstance(rope, dict):
        raise _refuse(key, rope, f"{key} is not an object", fix='give {"rope_type": "default", "rope_theta": ...}')
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        taken = " (transformers takes a non-empty rope_scaling over rope_parameters)" if key == "rope_scaling" else ""
        raise _refuse(f"{key}.rope_type", rope_type,
                      f"only the default RoPE is implemented; transformers would apply {rope_type!r} scaling{taken}",
                      fix="use rope_type 'default'" + (", or remove rope_scaling" if key == "rope_scaling" else ""))
    theta = rope["rope_theta"] if "rope_theta" in rope else text.get("rope_theta", TRANSFORMERS_FALLBACK_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        where = f"{key}.rope_theta" if "rope_theta" in rope else "rope_theta"
        raise _refuse(where, theta, "the RoPE base is not a number", fix="give a positive rope_theta")
    return theta


def text_values(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a config.json (nested or flat)."""
    text = config.get("text_config") if "text_config" in config else config
    if not isinstance(text, dict):
        raise RecipeError("config.json's text_config is not an object", field="config.json text_config",
                          value=type(text).__name__, fix="restore the checkpoint's config.json")
    kind = text.get("model_type")
    if kind not in (None, TEXT_MODEL_TYPE, TOP_MODEL_TYPE):
        raise _refuse("model_type", kind, "not a Muse Spark text config",
                      fix=f"use a Muse Spark checkpoint (model_type {TEXT_MODEL_TYPE!r})")
    ours = set(ModelConfig.model_fields)
    values: dict[str, Any] = {}
    for key, value in text.items():
        treatment = TEXT_FIELDS.get(key)
        if treatment == "field" or (treatment is None and key in ours):
            values[key] = value
    values.pop("rope_theta", None)  # a legacy top-level key: transformers reads it only as below
    values["rope_theta"] = rope_theta_as_transformers_reads(text)
    kinds = text.get("mlp_layer_types")
    if kinds is not None and any(k != "sparse" for k in kinds):
        raise _refuse("mlp_layer_types", kinds, "every Muse Spark layer is MoE; a dense layer is not supported",
                      fix="use a Muse Spark checkpoint (every entry 'sparse')")
    if "sliding_window" in values and values["sliding_window"] is None:
        raise _refuse("sliding_window", None, "a null sliding window (sliding layers attending everything) is "
                      "not implemented", fix="give the window length, or make every layer full_attention")
    if "max_position_embeddings" in values and values["max_position_embeddings"] is None:
        del values["max_position_embeddings"]  # an earlier muse-stack export wrote null: the default limit
    layers = values.get("num_hidden_layers", ModelConfig.model_fields["num_hidden_layers"].default)
    if values.get("layer_types") is not None and list(values["layer_types"]) == default_layer_types(layers):
        values["layer_types"] = None
    theta = values.get("rope_theta", ModelConfig.model_fields["rope_theta"].default)
    if values.get("layer_rope_theta") is not None and \
            [float(t) for t in values["layer_rope_theta"]] == [float(t) for t in default_layer_rope_theta(layers, theta)]:
        values["layer_rope_theta"] = None
    return values


def text_config(model: ModelConfig) -> dict[str, Any]:
    """transformers' ``text_config`` for ``model``: every key explicit, layer patterns resolved."""
    out: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE}
    for key, treatment in TEXT_FIELDS.items():
        if treatment == "field":
            out[key] = getattr(model, key)
    out["layer_types"] = model.resolved_layer_types
    out["layer_rope_theta"] = model.resolved_layer_rope_theta
    out["mlp_layer_types"] = ["sparse"] * model.num_hidden_layers
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": model.rope_theta}
    out["tie_word_embeddings"] = False
    out["use_cache"] = True
    for key in OWN_FIELDS:
        out[key] = getattr(model, key)
    return out
