"""Reference Muse Spark text decoder in plain PyTorch, with Hugging Face-style checkpoints."""

from muse_stack.models.muse_spark.checkpoint import LoadReport, load_checkpoint, load_weights_into, save_checkpoint
from muse_stack.models.muse_spark.decoder import (
    CausalLMOutput,
    MuseSparkDecoderLayer,
    MuseSparkForCausalLM,
    MuseSparkModel,
    MuseSparkTextModel,
)
from muse_stack.models.muse_spark.freeze import freeze, named_trainable_parameters, trainable_parameters, unfreeze
from muse_stack.models.muse_spark.init import INIT_STD, init_weights
from muse_stack.models.muse_spark.loss import IGNORE_INDEX, LossResult, causal_lm_loss, shift_labels
from muse_stack.models.muse_spark.packing import position_ids_from_segments, segment_ids_from_cu_seqlens

__all__ = [
    "CausalLMOutput",
    "IGNORE_INDEX",
    "INIT_STD",
    "LoadReport",
    "LossResult",
    "MuseSparkDecoderLayer",
    "MuseSparkForCausalLM",
    "MuseSparkModel",
    "MuseSparkTextModel",
    "causal_lm_loss",
    "freeze",
    "init_weights",
    "load_checkpoint",
    "load_weights_into",
    "named_trainable_parameters",
    "position_ids_from_segments",
    "save_checkpoint",
    "segment_ids_from_cu_seqlens",
    "shift_labels",
    "trainable_parameters",
    "unfreeze",
]
