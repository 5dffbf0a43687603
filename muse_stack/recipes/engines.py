"""What a recipe may ask of each training engine: the traits the resolve step
(:mod:`muse_stack.resolve.recipe`) checks, the planner and the machine check read, kept as data
at the recipes' level (the engines' behaviour, which imports torch and megatron-core, is
:mod:`muse_stack.engines.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from muse_stack.recipes.options import ROWS
from muse_stack.util.errors import RecipeError


def _option_fields(engine: str) -> frozenset[str]:
    """The engine options ``engine`` reads (``engine_options.<key>``, muse_stack/recipes/options.py)."""
    return frozenset(row.field for row in ROWS if engine in row.engines)


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
        runs_on_cpu=True, step_time_model=False, fields=_option_fields("reference"),
        stated=("batch.mbs", "batch.gbs", "layout.cp")),
    "megatron": EngineTraits(
        name="megatron", summary="the megatron-core engine, which runs megatron-core and Transformer Engine on CUDA",
        runs_on_cpu=False, step_time_model=True,
        fields=frozenset({"optimizer.precision_aware", "optimizer.param_remainders", "precision=fp8"})
        | _option_fields("megatron"),
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
        "precision=fp8": recipe.precision == "fp8",
        **{row.field: getattr(recipe.engine_options, row.key) is not None for row in ROWS},
    }
    for field, set_ in used.items():
        if set_ and field not in own:
            where = " or ".join(engines_reading(field))
            name = field.split("=")[0]
            value = field.split("=")[1] if "=" in field else \
                getattr(recipe.engine_options, field.split(".")[1]) if field.startswith("engine_options.") else True
            raise RecipeError(f"{field.replace('=', ': ')} applies to the {where} engine only",
                              field=name, value=value,
                              fix=f"set engine: {where}, or drop {name}" + ("" if "=" not in field
                                                                           else " (precision: bf16)"))
