"""Muse Spark's adapters (LoRA, DoRA) as the model defines them: a recipe's ``peft`` block
resolved against the model (targets checked, unstated values filled from a documented table),
adapter shapes and parameter counts.

Targets are the checkpoint (Hugging Face) names of modules inside one decoder layer; every
decoder layer gets the same adapters. The table of values a recipe may leave unstated is
Megatron-Bridge's ``LoRA`` / ``DoRA`` dataclass defaults (``megatron/bridge/peft/lora.py``,
``dora.py``): rank 32, alpha 32, dropout 0.0 applied to the adapter's input, A initialised
Xavier-normal and B zero. ``muse-stack plan`` prints each value it filled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from muse_stack.util.errors import RecipeError
from muse_stack.models.muse_spark.config import ModelConfig

#: attention projections (``self_attn.*``): column-parallel q/k/v/gate, row-parallel o
ATTENTION_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.gate_proj",
                     "self_attn.o_proj")
#: the latent MoE projections (H -> Hm before dispatch, Hm -> H after the combine)
LATENT_TARGETS = ("mlp.pre_expert_proj", "mlp.post_expert_proj")
#: the stacked routed experts (``[E, out, in]`` tensors)
EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
TARGETS = ATTENTION_TARGETS + LATENT_TARGETS + EXPERT_TARGETS
#: targets split over TP (ETP for experts) by their input rather than their output
ROW_PARALLEL = ("self_attn.o_proj", "mlp.experts.down_proj")
#: targets megatron-core keeps whole on every TP rank (its latent projections are "duplicated" TELinears)
DUPLICATED = LATENT_TARGETS

#: what a recipe may leave unstated, and the value used then (Megatron-Bridge's LoRA/DoRA defaults)
DEFAULTS: dict[str, object] = {"rank": 32, "alpha": 32.0, "dropout": 0.0}
DEFAULTS_SOURCE = "Megatron-Bridge LoRA/DoRA defaults (dim 32, alpha 32, dropout 0.0)"
#: fixed choices (not recipe fields), stated with every plan
INIT = "A: Xavier normal (seeded per tensor name), B: zero, DoRA magnitude: the row norms of the base weight"


@dataclass(frozen=True)
class PeftSettings:
    scheme: Literal["lora", "dora"]
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    per_expert: bool
    filled: tuple[str, ...] = field(default=())  #: "peft.rank = 32" for each value taken from DEFAULTS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def expert_targets(self) -> tuple[str, ...]:
        return tuple(t for t in self.targets if t in EXPERT_TARGETS)

    def as_dict(self) -> dict[str, object]:
        return {"scheme": self.scheme, "rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets), "per_expert": self.per_expert, "filled": list(self.filled)}


def target_shape(target: str, model: ModelConfig) -> tuple[int, int]:
    """(in_features, out_features) of a target's weight (one expert's, for the stacked experts)."""
    h, hm, i = model.hidden_size, model.moe_hidden_size, model.moe_intermediate_size
    hq, hkv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    return {"self_attn.q_proj": (h, hq), "self_attn.k_proj": (h, hkv), "self_attn.v_proj": (h, hkv),
            "self_attn.gate_proj": (h, hq), "self_attn.o_proj": (hq, h), "mlp.pre_expert_proj": (h, hm),
            "mlp.post_expert_proj": (hm, h), "mlp.experts.gate_up_proj": (hm, 2 * i),
            "mlp.experts.down_proj": (i, hm)}[target]


def local_shape(target: str, model: ModelConfig, *, tp: int = 1, etp: int = 1) -> tuple[float, float]:
    """(in, out) of a target's adapter factors on one GPU: A [r, in] splits over TP (ETP for
    expert targets) on a row-parallel linear, B [out, r] on a column-parallel one; the latent
    projections are whole on every TP rank (as Megatron-Bridge's ParallelLinearAdapter)."""
    fan_in, fan_out = target_shape(target, model)
    split = etp if target in EXPERT_TARGETS else 1 if target in DUPLICATED else tp
    return (fan_in / split, fan_out) if target in ROW_PARALLEL else (fan_in, fan_out / split)


def resolve(peft, model: ModelConfig) -> PeftSettings:
    """Check a recipe's ``peft`` block against the model and fill what it leaves unstated from
    :data:`DEFAULTS`. A target the model does not have, a repeated target or DoRA on a
    non-attention target is a :class:`RecipeError` naming it."""
    if not peft.targets:
        raise RecipeError("the adapters' targets are not stated; which modules train changes training, so no "
                          "default is taken", field="peft.targets", value=peft.targets,
                          fix="list them, e.g. peft.targets=[self_attn.q_proj,self_attn.v_proj] "
                              f"(modules of a decoder layer: {', '.join(TARGETS)})")
    seen: set[str] = set()
    for target in peft.targets:
        if target not in TARGETS:
            raise RecipeError(f"the model has no adapter target {target!r}", field="peft.targets", value=target,
                              rule="a target is the checkpoint name of a projection inside a decoder layer: "
                                   + ", ".join(TARGETS),
                              fix="use one of those names (the router mlp.gate, the norms, the embedding and "
                                  "lm_head take no adapters)")
        if target in seen:
            raise RecipeError(f"the adapter target {target!r} is listed twice", field="peft.targets", value=target,
                              fix="list each target once")
        seen.add(target)
    if peft.scheme == "dora":
        other = [t for t in peft.targets if t not in ATTENTION_TARGETS]
        if other:
            raise RecipeError(f"DoRA adapts the attention projections only; {other[0]} is not one",
                              field="peft.targets", value=other[0],
                              rule="Megatron-Bridge's DoRA has no per-expert or latent-projection adapters "
                                   "(the lora-64 source: 'DoRA ... keeps attention-only adapters')",
                              fix="keep only self_attn.* targets with peft.scheme=dora, or use peft.scheme=lora")
        if peft.per_expert:
            raise RecipeError("DoRA has no per-expert adapters", field="peft.per_expert", value=True,
                              fix="drop peft.per_expert (or set it false) with peft.scheme=dora")
    experts = [t for t in peft.targets if t in EXPERT_TARGETS]
    if experts and peft.per_expert is None:
        raise RecipeError(f"peft.per_expert is not stated for the expert target {experts[0]}: one adapter per "
                          "routed expert and one adapter shared by all experts train differently, so no default "
                          "is taken", field="peft.per_expert", value=None,
                          fix="set peft.per_expert=true (one adapter per expert, as lora-64) or false (one shared)")
    filled: list[str] = []
    values: dict[str, object] = {"per_expert": bool(peft.per_expert)}
    for name in ("rank", "alpha", "dropout"):
        value = getattr(peft, name)
        if value is None:
            value = DEFAULTS[name]
            filled.append(f"peft.{name} = {value}")
        values[name] = value
    return PeftSettings(scheme=peft.scheme, rank=int(values["rank"]), alpha=float(values["alpha"]),
                        dropout=float(values["dropout"]), targets=tuple(peft.targets),
                        per_expert=bool(values["per_expert"]), filled=tuple(filled))


def adapter_params_per_layer(settings: PeftSettings, model: ModelConfig, *, tp: int = 1, ep: int = 1,
                             etp: int = 1) -> tuple[int, int]:
    """(dense, expert) adapter parameters of one decoder layer held by one GPU.

    LoRA on a column-parallel linear keeps A [r, in] whole and splits B [out, r] over TP; on a
    row-parallel linear A [r, in] splits and B stays whole (as Megatron-Bridge's
    ParallelLinearAdapter); expert adapters split over ETP the same way, and each EP rank holds
    its E / EP experts' adapters (one shared adapter when ``per_expert`` is off). The latent
    projections are whole on every TP rank, and so are their adapters. DoRA adds the magnitude
    vector [out], split with the base weight's rows.
    """
    r = settings.rank
    dense = expert = 0
    for target in settings.targets:
        fan_in, fan_out = (int(n) for n in local_shape(target, model, tp=tp, etp=etp))
        count = r * fan_in + r * fan_out
        magnitude = fan_out  # DoRA's magnitude follows the base weight's (local) rows
        if settings.scheme == "dora":
            count += magnitude
        if target in EXPERT_TARGETS:
            expert += count * (model.num_local_experts // ep if settings.per_expert else 1)
        else:
            dense += count
    return dense, expert
