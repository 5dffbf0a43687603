"""The harnesses' hold on the megatron engine: the engine built on given weights (a reference
model's HF-named state dict, and its adapters) instead of the recipe's pretrained checkpoint or
seed, and one micro-batch's loss or logits without an update (PP 1).

The runner never needs either: it loads a pretrained checkpoint (``TrainContext.pretrained_checkpoint``)
or starts from the seed, and evaluates whole held-out batches (``MegatronEngine.evaluate``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from muse_stack.engines.base import TrainContext
from muse_stack.engines.mcore.load import Index, Slices
from muse_stack.engines.megatron import MegatronEngine, supervised_mask


class StateDictSlices(Slices):
    """Part-reads of an in-memory state dict (HF names), as
    :class:`~muse_stack.engines.mcore.load.CheckpointSlices` reads a checkpoint's files."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.state = state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def _read(self, name: str, index: Index) -> torch.Tensor:
        return self.state[name][index] if index else self.state[name]


class LoadedEngine(MegatronEngine):
    """The megatron engine whose model starts from ``state`` (HF names, read through the weight
    mapping as a checkpoint is, each rank taking its part) and, with ``recipe.peft``, whose adapters
    start from ``adapters`` (the reference's names; where ``adapters`` holds no DoRA magnitudes, they
    are the row norms of the base with these adapters, as the engine sets its own). Both are loaded
    where the engine loads its own, before DDP and the optimizer are built."""

    def __init__(self, ctx: TrainContext, state: dict[str, torch.Tensor],
                 adapters: dict[str, torch.Tensor] | None = None) -> None:
        if ctx.pretrained_checkpoint:
            raise ValueError("LoadedEngine: the weights come from `state`; leave ctx.pretrained_checkpoint unset")
        if adapters is not None and ctx.recipe.peft is None:
            raise ValueError("LoadedEngine: adapters given for a recipe without peft")
        self._state, self._adapters = state, adapters
        super().__init__(ctx)

    def _build_model(self, seed: int):
        from muse_stack.engines.mcore.load import load_hf_weights

        model = super()._build_model(seed)  # initialised from the seed; load_hf_weights copies every weight
        load_hf_weights(model, StateDictSlices(self._state), **self.load_kwargs)
        return model

    def _attach_adapters(self, model, seed: int) -> None:
        super()._attach_adapters(model, seed)  # the reference's initial adapters, DoRA's magnitudes set
        if self._adapters is None:
            return
        from muse_stack.engines.mcore import peft as mpeft

        mpeft.load_reference_adapters(model, self._adapters, layer_offset=self.load_kwargs["layer_offset"],
                                      expert_offset=self.load_kwargs["expert_offset"],
                                      tp_rank=self.load_kwargs["tp_rank"], tp_size=self.load_kwargs["tp_size"],
                                      magnitudes_required=False)
        if self.peft.scheme == "dora" and not any(k.endswith("lora_magnitude") for k in self._adapters):
            mpeft.init_magnitudes(model)  # the row norms of the base with these adapters, as the engine sets them


@torch.no_grad()
def eval_loss(engine: MegatronEngine, mb: dict[str, Any]) -> tuple[float, int]:
    """Mean supervised-token loss of one micro-batch on this rank (PP = 1), no update."""
    engine.model.eval()
    try:
        batch = engine._prepare(mb)
        out = engine.model(batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                           packed_seq_params=batch.get("packed_seq_params"), media=batch.get("media"),
                           media_index=batch.get("media_index"))
        mask = supervised_mask(batch)
        return float(out.sum()) / max(int(mask.sum()), 1), int(mask.sum())
    finally:
        engine.model.train()


@torch.no_grad()
def eval_logits(engine: MegatronEngine, mb: dict[str, Any]) -> torch.Tensor:
    """Soft-capped logits [b, s, V / TP] of one micro-batch (PP = 1)."""
    engine.model.eval()
    try:
        batch = engine._prepare(mb)
        return engine.model(batch["input_ids"], packed_seq_params=batch.get("packed_seq_params"),
                            media=batch.get("media"), media_index=batch.get("media_index")).transpose(0, 1).float()
    finally:
        engine.model.train()
