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
  merged token. A tower that does not train keeps none.
"""

from __future__ import annotations

from dataclasses import dataclass

from muse_stack.models.muse_spark.tower_config import MAX_IMAGE_TOKENS
from muse_stack.models.muse_spark.flops import tower_flops_per_sequence
from muse_stack.models.muse_spark.tower_config import TowersConfig

#: names in ``frozen`` that freeze the projector
PROJECTOR_NAMES = ("vision_adapter", "vision_projection", "projector")


@dataclass(frozen=True)
class TowerPlan:
    towers: TowersConfig
    text_hidden_size: int
    vision_trains: bool
    audio_trains: bool
    projector_trains: bool
    image_tokens_per_sequence: int | None  # merged tokens; None without a sequence length
    image_tokens_source: str

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

    def activation_bytes_per_sequence(self, act_bytes: int, recomputed: bool) -> float:
        """Bytes the towers keep for the backward pass per sequence (see the module docstring)."""
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

    def describe(self) -> list[str]:
        parts = {"vision tower": self.vision_trains, "audio tower": self.audio_trains,
                 "projector": self.projector_trains}
        trains = ", ".join(k for k, v in parts.items() if v) or "nothing"
        frozen = ", ".join(k for k, v in parts.items() if not v) or "nothing"
        return [f"perception towers: {self.params:,} parameters whole on every GPU of the first pipeline stage "
                f"(not split over TP; replicated over DP, optimizer state sharded over DP x CP); training {trains}, "
                f"frozen {frozen}",
                f"perception workload: one image of {self.image_tokens_per_sequence or '?'} merged tokens per sequence "
                f"({self.image_tokens_source}), the whole image on every CP rank; the audio tower does not run on "
                "image-text data"]


def tower_plan(resolved) -> TowerPlan | None:
    """The towers of a resolved image-text recipe (or one whose model states ``model.towers``;
    :class:`muse_stack.resolve.recipe.ResolvedRecipe`), else None."""
    recipe, towers = resolved.recipe, resolved.towers
    if towers is None:
        return None
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
                     image_tokens_per_sequence=tokens, image_tokens_source=source)
