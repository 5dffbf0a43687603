"""Reference Muse Spark text decoder in plain PyTorch, with Hugging Face-style checkpoints.

The names below load on first use (PEP 562): importing a torch-free module of this package (its
config, for a recipe) does not import torch, so the command line and its completion start fast."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(("LoadReport", "load_checkpoint", "load_weights_into", "save_checkpoint"), "checkpoint"),
    **dict.fromkeys(("CausalLMOutput", "MuseSparkDecoderLayer", "MuseSparkForCausalLM", "MuseSparkModel",
                     "MuseSparkTextModel"), "decoder"),
    **dict.fromkeys(("freeze", "named_trainable_parameters", "trainable_parameters", "unfreeze"), "freeze"),
    **dict.fromkeys(("INIT_STD", "init_weights"), "init"),
    **dict.fromkeys(("IGNORE_INDEX", "LossResult", "causal_lm_loss", "shift_labels"), "loss"),
    **dict.fromkeys(("position_ids_from_segments", "segment_ids_from_cu_seqlens"), "packing"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from muse_stack.models.muse_spark.checkpoint import LoadReport, load_checkpoint, load_weights_into, save_checkpoint
    from muse_stack.models.muse_spark.decoder import (CausalLMOutput, MuseSparkDecoderLayer, MuseSparkForCausalLM,
                                                      MuseSparkModel, MuseSparkTextModel)
    from muse_stack.models.muse_spark.freeze import freeze, named_trainable_parameters, trainable_parameters, unfreeze
    from muse_stack.models.muse_spark.init import INIT_STD, init_weights
    from muse_stack.models.muse_spark.loss import IGNORE_INDEX, LossResult, causal_lm_loss, shift_labels
    from muse_stack.models.muse_spark.packing import position_ids_from_segments, segment_ids_from_cu_seqlens
