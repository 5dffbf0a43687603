"""The perception towers in a plan: what an image-text recipe's first pipeline stage holds and
computes besides the embedding and its decoder layers.

Stated choices (each reported in the plan's assumptions):

* **Placement**: both towers and the projector sit whole on every GPU of the first pipeline stage
  (the seed's placement: "the first stage holds the embedding with the perception towers"); they
  are not split over TP (transformers states no tensor-parallel layout for them) and are
  replicated over DP like the dense decoder weights, their optimizer state sharded over DP x CP
  by the distributed optimizer.
* **What trains**: the vision tower and the projector unless ``frozen`` names them (or the whole
  base is frozen, as with adapters); the audio tower unless ``frozen`` names it. A frozen part
  holds its bf16 weights only.
* **Workload**: image-text data feeds the vision tower only (the audio tower does not run). Each
  sequence holds one image of ``data.details.image_tokens_per_sequence`` merged tokens when the
  recipe states it, else of ``min(max_image_tokens, seq_length)``: the image processor's cap
  (4096), an upper bound. Every CP rank runs the towers on the whole image (transformers defines
  no split of them).
* **Activations** of a vision layer per patch: ``bytes x (7 D + 2 I)`` (the two norms' outputs, q,
  k, v, the attention output and projection input, the MLP's two I-wide tensors); when the vision
  blocks are recomputed (``recompute.towers``, on by default under full recompute) only each
  layer's input, ``bytes x D``; the projector ``bytes x (out + 2 P + H)`` per
  merged token. A tower that does not train keeps none. ``bytes`` is the towers' activation dtype's
  (``TowerPlan.activations_dtype``): fp32 between the bf16 GEMMs as the towers run by default (so a recomputed
  block's kept input is fp32), bf16 under ``engine_options.towers_bf16_activations``.
* **Memory traffic** outside the GEMMs and attention (norms, casts between the bf16 GEMMs and the fp32
  activations, RoPE, GELU, residual adds, the attention groups' gathers and scatters, and their backward):
  bytes per patch counted by running the towers' code (:mod:`muse_stack.models.muse_spark.traffic`) with the
  recipe's parameter and activation dtypes, read
  from ``tower_traffic.json`` beside this module (``benchmarks/scripts/plan/tower_traffic.py --write``
  writes it for every tower shape of the shipped recipes); a shape it does not hold is counted when it is
  planned, where torch is installed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from muse_stack.models.muse_spark.tower_config import MAX_IMAGE_TOKENS
from muse_stack.models.muse_spark.flops import tower_flops_per_sequence
from muse_stack.models.muse_spark.tower_config import TowersConfig

#: names in ``frozen`` that freeze the projector
PROJECTOR_NAMES = ("vision_adapter", "vision_projection", "projector")
#: the towers' memory traffic per patch, by tower shape (see the module docstring)
TRAFFIC_FILE = Path(__file__).with_name("tower_traffic.json")
#: the command that writes TRAFFIC_FILE, its only writer
TRAFFIC_COMMAND = "python benchmarks/scripts/plan/tower_traffic.py --write"

Bytes = Field(ge=0, allow_inf_nan=False)


class TrafficParts(BaseModel):
    """Bytes per patch of one micro-batch: the work outside the encoder layers (per merged token it is per
    patch x merge_size^2), and that of one window-attention and one full-attention layer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outside_layers: float = Bytes
    window_attention: float = Bytes
    full_attention: float = Bytes

    def per_patch(self, layer_types: list[str]) -> float:
        """Bytes per patch of a vision tower of ``layer_types``."""
        return self.outside_layers + sum(n * getattr(self, kind) for kind, n in Counter(layer_types).items())


class TrafficCount(BaseModel):
    """The count for one tower shape (:func:`muse_stack.models.muse_spark.traffic.count`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: what the count depends on (:func:`traffic_shape`)
    shape: dict[str, Any]
    #: the frames (t, h, w) of the two micro-batches whose difference gives the bytes per patch
    frames: list[tuple[int, int, int]]
    forward: TrafficParts
    #: the vision tower and the projector training, the vision blocks kept, and recomputed
    backward: TrafficParts
    backward_recomputed: TrafficParts
    #: the vision tower frozen, the projector training (outside the layers only)
    backward_projector: float = Bytes


class TrafficFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    #: the command that writes the file again
    command: str
    counts: list[TrafficCount]


def towers_params_dtype(precision: str | None) -> str:
    """The parameters' dtype the megatron engine builds the towers in (``params_dtype`` of
    muse_stack/engines/mcore/config.py): bf16 under ``precision`` bf16 and fp8, else fp32."""
    return "bfloat16" if precision in ("bf16", "fp8") else "float32"


def towers_activations_dtype(params_dtype: str, bf16_activations: bool) -> str:
    """The dtype of the vision tower's activations between its GEMMs (``MuseSparkVisionModel.activations_dtype``):
    the bf16 weights' dtype under ``engine_options.towers_bf16_activations``, else fp32."""
    return "bfloat16" if bf16_activations and params_dtype == "bfloat16" else "float32"


def traffic_shape(towers: TowersConfig, text_hidden_size: int, dtype: str, activations: str) -> dict[str, Any]:
    """What the towers' memory traffic per patch depends on: the vision tower's configuration but its
    number and kinds of layers (counted per layer), the projector's widths, the parameters' dtype and the
    activations' (:func:`towers_activations_dtype`)."""
    vision = towers.vision_config.model_dump(mode="json", exclude={"num_hidden_layers", "layer_types"})
    return {"vision_config": vision,
            "out_hidden_size": towers.out_hidden_size, "projector_hidden_size": towers.projector_hidden_size,
            "text_hidden_size": text_hidden_size, "params_dtype": dtype, "activations_dtype": activations}


def count_traffic(shape: dict[str, Any]) -> TrafficCount:
    """Count the traffic of a shape (:func:`traffic_shape`) by running the towers' code (needs torch):
    :func:`muse_stack.models.muse_spark.traffic.count`."""
    import torch

    from muse_stack.models.muse_spark.traffic import count, counting_frames

    vision = {**shape["vision_config"], "num_hidden_layers": 1}
    towers = TowersConfig(vision_config=vision, out_hidden_size=shape["out_hidden_size"],
                          projector_hidden_size=shape["projector_hidden_size"],
                          audio_config={"out_hidden_size": shape["text_hidden_size"]})  # the audio tower does not run
    got = count(towers, shape["text_hidden_size"], getattr(torch, shape["params_dtype"]),
                activations_dtype=getattr(torch, shape["activations_dtype"]))
    return TrafficCount(shape=shape, frames=counting_frames(towers)[:2], forward=got.forward, backward=got.backward,
                        backward_recomputed=got.backward_recomputed, backward_projector=got.backward_projector)


@cache
def _traffic(shape_json: str) -> tuple[TrafficCount, bool]:
    """The count of a shape (:func:`traffic_shape`, as JSON) and whether it was read from TRAFFIC_FILE
    (else counted now, where torch is installed)."""
    from muse_stack.util.datafile import load

    shape = json.loads(shape_json)
    for entry in load(TRAFFIC_FILE, TrafficFile).counts:
        if entry.shape == shape:
            return entry, True
    try:
        import torch  # noqa: F401
    except ImportError:
        from muse_stack.util.errors import InputError

        raise InputError(f"{TRAFFIC_FILE.name} holds no count of the towers' memory traffic for this tower shape "
                         "and precision, and counting it needs torch", field="model.towers",
                         value=shape, fix=f"install torch (pip install 'muse-stack[cpu]') to count it when planning, "
                                          f"or add the shape to a shipped recipe and run {TRAFFIC_COMMAND}") from None
    return count_traffic(shape), False


@dataclass(frozen=True)
class TowerPlan:
    towers: TowersConfig
    text_hidden_size: int
    vision_trains: bool
    audio_trains: bool
    projector_trains: bool
    image_tokens_per_sequence: int | None  # merged tokens; None without a sequence length
    image_tokens_source: str
    params_dtype: str = "bfloat16"  # the towers' parameters (params_dtype)
    activations_dtype: str = "float32"  # the vision tower's activations between its GEMMs

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element (:attr:`activations_dtype`)."""
        return {"bfloat16": 2, "float32": 4}[self.activations_dtype]

    @property
    def params(self) -> int:
        return self.towers.parameter_count(self.text_hidden_size)

    @property
    def trainable_params(self) -> int:
        t = self.towers
        return (t.vision_config.parameter_count * self.vision_trains
                + t.audio_config.parameter_count * self.audio_trains
                + t.projector_parameter_count(self.text_hidden_size) * self.projector_trains)

    def flops_per_sequence(self) -> dict[str, float] | None:
        if not self.image_tokens_per_sequence:
            return None
        return tower_flops_per_sequence(self.towers, self.text_hidden_size, self.image_tokens_per_sequence,
                                        vision_trains=self.vision_trains, projector_trains=self.projector_trains)

    def activation_bytes_per_sequence(self, recomputed: bool) -> float:
        """Bytes the towers keep for the backward pass per sequence (see the module docstring)."""
        act_bytes = self.activation_bytes
        if not self.image_tokens_per_sequence:
            return 0.0
        v = self.towers.vision_config
        tokens = self.image_tokens_per_sequence
        patches = tokens * v.merge_size**2
        out = 0.0
        if self.vision_trains:
            per_layer = v.hidden_size if recomputed else 7 * v.hidden_size + 2 * v.intermediate_size
            out += act_bytes * per_layer * v.num_hidden_layers * patches
        if self.projector_trains:
            p = self.towers.projector_hidden_size
            out += act_bytes * (self.towers.out_hidden_size + 2 * p + self.text_hidden_size) * tokens
        return out

    def traffic(self) -> tuple[TrafficCount, bool]:
        """The towers' memory traffic per patch (see the module docstring) and whether it was read from
        TRAFFIC_FILE (else counted now)."""
        return _traffic(json.dumps(traffic_shape(self.towers, self.text_hidden_size, self.params_dtype,
                                                 self.activations_dtype), sort_keys=True))

    def traffic_bytes_per_patch(self, recomputed: bool) -> float:
        """Bytes per patch the towers move outside their GEMMs and attention in one micro-batch: the forward,
        the backward where a part trains (with the recomputed forward of the vision blocks where
        ``recomputed``: ``recompute_towers()``; a frozen projector's backward differs from a trained one's
        only by its weight-gradient GEMMs), none for a frozen part."""
        count, _ = self.traffic()
        types = self.towers.vision_config.layer_types
        out = count.forward.per_patch(types)
        if self.vision_trains:
            out += (count.backward_recomputed if recomputed else count.backward).per_patch(types)
        elif self.projector_trains:
            out += count.backward_projector
        return out

    def describe(self) -> list[str]:
        parts = {"vision tower": self.vision_trains, "audio tower": self.audio_trains,
                 "projector": self.projector_trains}
        trains = ", ".join(k for k, v in parts.items() if v) or "nothing"
        frozen = ", ".join(k for k, v in parts.items() if not v) or "nothing"
        return [f"perception towers: {self.params:,} parameters whole on every GPU of the first pipeline stage "
                f"(not split over TP; replicated over DP, optimizer state sharded over DP x CP); training {trains}, "
                f"frozen {frozen}; the vision tower's activations in {self.activations_dtype} between its GEMMs "
                + ("(engine_options.towers_bf16_activations)" if self.activations_dtype == "bfloat16" else
                   f"(its GEMMs in {self.params_dtype})"),
                f"perception workload: one image of {self.image_tokens_per_sequence or '?'} merged tokens per sequence "
                f"({self.image_tokens_source}), the whole image on every CP rank; the audio tower does not run on "
                "image-text data"]


def tower_plan(resolved) -> TowerPlan | None:
    """The towers of a resolved image-text recipe (or one whose model states ``model.towers``;
    :class:`muse_stack.resolve.recipe.ResolvedRecipe`), else None."""
    from muse_stack.recipes import options as engine_options

    recipe, towers = resolved.recipe, resolved.towers
    if towers is None:
        return None
    params_dtype = towers_params_dtype(recipe.precision)
    frozen = set(recipe.frozen)
    base = recipe.peft is not None or "base" in frozen
    stated = recipe.data.details.get("image_tokens_per_sequence")
    cap = recipe.data.details.get("max_image_tokens", MAX_IMAGE_TOKENS)
    seq = recipe.batch.seq_length
    if stated is not None and not (isinstance(stated, int) and not isinstance(stated, bool) and stated > 0):
        from muse_stack.util.errors import RecipeError

        raise RecipeError("must be a positive whole number of merged image tokens",
                          field="data.details.image_tokens_per_sequence", value=stated,
                          fix="give the image tokens of a typical sequence, or leave it out (the plan then takes "
                              "the image processor's cap, an upper bound)")
    if stated is not None:
        tokens, source = stated, "data.details.image_tokens_per_sequence"
    elif seq:
        tokens = min(cap, seq)
        source = (f"not stated: the image processor's cap of {cap} merged tokens" if cap <= seq else
                  f"not stated: the whole sequence of {seq}") + \
            ", an upper bound (state data.details.image_tokens_per_sequence)"
    else:
        tokens, source = None, "batch.seq_length not stated"
    return TowerPlan(towers=towers, text_hidden_size=resolved.model.hidden_size,
                     vision_trains=not base and "vision_tower" not in frozen,
                     audio_trains=not base and "audio_tower" not in frozen,
                     projector_trains=not base and not frozen & set(PROJECTOR_NAMES),
                     image_tokens_per_sequence=tokens, image_tokens_source=source,
                     params_dtype=params_dtype,
                     activations_dtype=towers_activations_dtype(
                         params_dtype, engine_options.is_on(engine_options.resolve(recipe), "towers_bf16_activations")))
