"""What a recipe may ask of each training engine: the traits the resolve step
(:mod:`muse_stack.recipes.resolve`) checks, the planner and the machine check read, kept as data
at the recipes' level (the engines' behaviour, which imports torch and megatron-core, is
:mod:`muse_stack.engines.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from muse_stack.util.errors import RecipeError

if TYPE_CHECKING:
    from muse_stack.recipes.schema import Recipe


#: the megatron engine's fusion and performance settings (recipe.fusions / recipe.performance; unset: as
#: the engine ships): set on another engine, they are refused
MEGATRON_SETTINGS = ("fusions.gradient_accumulation", "fusions.permute", "fusions.router",
                     "performance.clip_on_device", "performance.optimizer_cuda_graph", "performance.overlap_grad_reduce",
                     "performance.first_micro_batch_writes", "performance.triton_adam",
                     "performance.embedding_into_main_grad")


@dataclass(frozen=True)
class EngineTraits:
    name: str
    summary: str
    runs_on_cpu: bool  #: a recipe with ``hardware.gpu: cpu`` runs on it
    step_time_model: bool  #: ``muse-stack plan`` models its step time (muse_stack/plan/cost.py)
    #: recipe fields only this engine reads: set on another engine, they are refused
    fields: frozenset[str]
    #: the sizes it starts from, which it fills none of in: unstated, the recipe is refused
    stated: tuple[str, ...]


TRAITS: dict[str, EngineTraits] = {
    "reference": EngineTraits(
        name="reference", summary="the PyTorch reference engine (CPU or GPU, data-parallel only)",
        runs_on_cpu=True, step_time_model=False, fields=frozenset(),
        stated=("batch.mbs", "batch.gbs", "layout.cp")),
    "megatron": EngineTraits(
        name="megatron", summary="the megatron-core engine, which runs megatron-core and Transformer Engine on CUDA",
        runs_on_cpu=False, step_time_model=True,
        fields=frozenset({"optimizer.precision_aware", "optimizer.param_remainders", "fusions.compile_elementwise",
                          "precision=fp8", *MEGATRON_SETTINGS}),
        stated=("batch.mbs", "batch.gbs", "batch.seq_length", "layout.cp", "layout.ep")),
}


def traits(name: str) -> EngineTraits:
    try:
        return TRAITS[name]
    except KeyError:
        raise RecipeError("not an engine", field="engine", value=name,
                          fix=f"use one of {', '.join(sorted(TRAITS))}") from None


def engines_reading(field: str) -> list[str]:
    return sorted(name for name, t in TRAITS.items() if field in t.fields)


def refuse_fields_of_other_engines(recipe) -> None:
    """A recipe field only another engine reads is refused, naming the field and that engine."""
    own = traits(recipe.engine).fields
    used = {
        "optimizer.precision_aware": bool(recipe.optimizer.precision_aware),
        "optimizer.param_remainders": bool(recipe.optimizer.param_remainders),
        "fusions.compile_elementwise": bool(recipe.fusions.compile_elementwise),
        "precision=fp8": recipe.precision == "fp8",
        **{field: _value(recipe, field) is not None for field in MEGATRON_SETTINGS},
    }
    for field, set_ in used.items():
        if set_ and field not in own:
            where = " or ".join(engines_reading(field))
            name = field.split("=")[0]
            value = field.split("=")[1] if "=" in field else _value(recipe, field) if field in MEGATRON_SETTINGS else True
            raise RecipeError(f"{field.replace('=', ': ')} applies to the {where} engine only",
                              field=name, value=value,
                              fix=f"set engine: {where}, or drop {name}" + ("" if "=" not in field
                                                                           else " (precision: bf16)"))


def _value(recipe, field: str):
    section, key = field.split(".")
    return getattr(getattr(recipe, section), key)


def triton_adam_blocker(recipe: Recipe) -> str | None:
    """Why the megatron engine steps the recipe's optimizer with TE's FusedAdam and not its Triton step
    (``muse_stack/engines/mcore/adam_step.py``; None: it can): the Triton step is TE's FusedAdam's with
    fp32 master weights, stepped eagerly. The engine refuses ``performance.triton_adam: true`` for these
    reasons, and the planner prices the step by the kernel this chooses."""
    opt = recipe.optimizer
    if not opt.precision_aware:
        return "it steps TE's FusedAdam, which holds the master weights only under optimizer.precision_aware"
    if opt.param_remainders:
        return "it keeps fp32 master weights, not optimizer.param_remainders"
    if recipe.performance.optimizer_cuda_graph:
        return "performance.optimizer_cuda_graph captures TE's capturable step instead"
    return None


def embedding_into_main_grad_blocker(recipe: Recipe) -> str | None:
    """Why the megatron engine's word embedding keeps megatron-core's dense lookup under this recipe
    (None: its backward can add into main_grad, ``muse_stack/engines/mcore/embedding_grad.py``); read by
    the engine's check and by the planner alike."""
    if recipe.peft is not None:
        return "the embedding is frozen under peft"
    if recipe.layout.tp > 1:
        return "the table is split over layout.tp: megatron-core masks the other ranks' ids around its lookup"
    return None
