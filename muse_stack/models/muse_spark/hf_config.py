"""config.json in transformers' ``muse_spark`` layout, read and written with transformers' meanings.

transformers 5.24.0 (``models/muse_spark/configuration_muse_spark.py``) is the model's public
definition. Its ``MuseSparkConfig`` nests the decoder's keys under ``text_config``
(``model_type: muse_spark_text``) beside ``vision_config``, ``audio_config`` and the media token
ids. The text keys, and the way muse-stack reads each (:data:`TEXT_FIELDS`), belong to
:mod:`muse_stack.models.muse_spark.config`; this module writes the whole config.json around them.

A text-only model still needs tower configs and weights: transformers builds both towers from
any config, and builds the full-size ones (1.85 B + 118 M parameters, randomly initialised) when
the configs are left out. :func:`placeholder_perception` gives the smallest consistent towers
instead; the export says so in its model card.
"""

from __future__ import annotations

from typing import Any

from muse_stack.util.errors import RecipeError
from muse_stack.models.muse_spark.config import TEXT_FIELDS, TEXT_MODEL_TYPE, TOP_MODEL_TYPE, ModelConfig, text_config

__all__ = ["TEXT_FIELDS", "TEXT_MODEL_TYPE", "TOP_MODEL_TYPE", "full_config", "perception_of",
           "placeholder_perception"]

ARCHITECTURES = ["MuseSparkForConditionalGeneration"]

#: the top-level MuseSparkConfig keys that describe the perception towers and the media tokens
PERCEPTION_KEYS = ("vision_config", "audio_config", "image_token_id", "video_token_id", "audio_token_id",
                   "out_hidden_size", "projector_hidden_size", "projector_hidden_act")


def placeholder_perception(model: ModelConfig) -> dict[str, Any]:
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


def full_config(model: ModelConfig, perception: dict[str, Any] | None = None) -> dict[str, Any]:
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
