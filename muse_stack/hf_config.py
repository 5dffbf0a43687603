"""config.json in transformers' ``muse_spark`` layout, read and written with transformers' meanings.

transformers 5.24.0 (``models/muse_spark/configuration_muse_spark.py``) is the model's public
definition. Its ``MuseSparkConfig`` nests the decoder's keys under ``text_config``
(``model_type: muse_spark_text``) beside ``vision_config``, ``audio_config`` and the media token
ids. :data:`TEXT_FIELDS` lists every field of ``MuseSparkTextConfig`` with the way muse-stack
reads it; a value muse-stack cannot compute the way transformers does is refused, naming the key,
never read differently.

A text-only model still needs tower configs and weights: transformers builds both towers from
any config, and builds the full-size ones (1.85 B + 118 M parameters, randomly initialised) when
the configs are left out. :func:`placeholder_perception` gives the smallest consistent towers
instead; the export says so in its model card.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from muse_stack.errors import RecipeError

if TYPE_CHECKING:
    from muse_stack.model_config import ModelConfig

TOP_MODEL_TYPE = "muse_spark"
TEXT_MODEL_TYPE = "muse_spark_text"
ARCHITECTURES = ["MuseSparkForConditionalGeneration"]

#: every field of transformers' MuseSparkTextConfig (and its PreTrainedConfig base) -> how it is read
TEXT_FIELDS: dict[str, str] = {
    # same name, same meaning (muse_stack.model_config.ModelConfig)
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "initializer_range", "rms_norm_eps",
         "pad_token_id", "eos_token_id", "bos_token_id", "tie_word_embeddings", "attention_bias",
         "attention_dropout", "sliding_window", "layer_types", "final_logit_softcapping", "qk_scale_factor",
         "output_multiplier", "post_norm_eps", "layer_rope_theta", "hidden_act", "moe_intermediate_size",
         "num_local_experts", "num_experts_per_tok", "routed_scaling_factor", "moe_hidden_size",
         "residual_gate_temperature"), "field"),
    "rope_parameters": "rope_theta, with rope_type 'default' (no other RoPE scaling is implemented)",
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


def text_values(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments from a config.json (nested or flat)."""
    from muse_stack.model_config import ModelConfig, default_layer_rope_theta, default_layer_types

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
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if rope is not None:
        if not isinstance(rope, dict):
            raise _refuse("rope_parameters", rope, "rope_parameters is not an object",
                          fix='give {"rope_type": "default", "rope_theta": ...}')
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise _refuse("rope_parameters.rope_type", rope_type,
                          "only the default RoPE is implemented; this scaling would be read as plain RoPE",
                          fix="use rope_type 'default'")
        if "rope_theta" in rope and "rope_theta" not in values:
            values["rope_theta"] = rope["rope_theta"]
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


def text_config(model: "ModelConfig") -> dict[str, Any]:
    """transformers' ``text_config`` for ``model``: every key explicit, layer patterns resolved."""
    out: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE}
    for key, treatment in TEXT_FIELDS.items():
        if treatment == "field":
            out[key] = getattr(model, key)
    out["layer_types"] = model.resolved_layer_types
    out["layer_rope_theta"] = model.resolved_layer_rope_theta
    out["mlp_layer_types"] = ["sparse"] * model.num_hidden_layers
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": model.rope_theta}
    out["use_cache"] = True
    for key in OWN_FIELDS:
        out[key] = getattr(model, key)
    return out


#: the top-level MuseSparkConfig keys that describe the perception towers and the media tokens
PERCEPTION_KEYS = ("vision_config", "audio_config", "image_token_id", "video_token_id", "audio_token_id",
                   "out_hidden_size", "projector_hidden_size", "projector_hidden_act")


def placeholder_perception(model: "ModelConfig") -> dict[str, Any]:
    """The smallest towers consistent with ``model`` (transformers' contract kept: 14-pixel
    patches in 2-frame temporal groups, a 2x2 merge, one audio token per 1920 samples)."""
    vision_width = 8
    return {
        "vision_config": {"model_type": "muse_spark_vision", "hidden_size": vision_width, "intermediate_size": 8,
                          "num_hidden_layers": 1, "num_attention_heads": 1, "pos_emb_height": 2,
                          "pos_emb_width": 2, "max_position_embeddings": 4, "patch_size": 14,
                          "patch_temporal": 2, "merge_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
                          "layer_types": ["full_attention"],
                          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}},
        "audio_config": {"model_type": "muse_spark_audio", "patch_sizes": [1920], "hidden_sizes": [8],
                         "depths": [1], "num_hidden_layers": 1, "mlp_ratio": 4.0, "conv_kernel_size": 7,
                         "hidden_act": "gelu", "rms_norm_eps": 1e-6, "out_hidden_size": model.hidden_size,
                         "initializer_range": model.initializer_range},
        "image_token_id": 200092,
        "video_token_id": 200091,
        "audio_token_id": 200038,
        "out_hidden_size": vision_width * 4,
        "projector_hidden_size": 8,
        "projector_hidden_act": "gelu",
    }


def perception_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """The tower and media keys of a nested config.json, or None when it has no towers."""
    if "vision_config" not in config or "audio_config" not in config:
        return None
    return {key: config[key] for key in PERCEPTION_KEYS if key in config}


def full_config(model: "ModelConfig", perception: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole ``MuseSparkConfig`` config.json: ``model``'s text_config and ``perception``
    (the towers of the checkpoint the weights came from), else :func:`placeholder_perception`."""
    towers = dict(perception) if perception is not None else placeholder_perception(model)
    audio = dict(towers["audio_config"])
    if audio.get("out_hidden_size", model.hidden_size) != model.hidden_size:
        raise RecipeError("the audio tower's output width differs from the text hidden size",
                          field="config.json audio_config.out_hidden_size", value=audio.get("out_hidden_size"),
                          fix=f"the audio features are scattered onto the text embeddings: use {model.hidden_size}")
    towers["audio_config"] = audio
    return {"model_type": TOP_MODEL_TYPE, "architectures": list(ARCHITECTURES),
            "text_config": text_config(model), **towers, "tie_word_embeddings": False}
