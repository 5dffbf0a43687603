"""What the engines can train, checked on the recipe before a run writes anything.

A recipe can ask for more than an engine does; those requests are refused here, naming the
field, rather than trained differently from what the recipe says.
"""

from __future__ import annotations

from muse_stack.errors import RecipeError
from muse_stack.recipes.schema import Recipe

#: perception towers: not part of the text decoder either engine builds, so freezing them holds
TOWERS = ("vision_tower", "audio_tower")


def check_recipe(recipe: Recipe) -> None:
    """Raise a RecipeError for anything the recipe's engine would not train as written."""
    if recipe.peft is not None:
        raise RecipeError(f"neither engine trains {recipe.peft.scheme.upper()} adapters yet; this recipe can be "
                          "planned but not run", field="peft", value=recipe.peft.scheme,
                          fix="`muse-stack plan` it; to train, drop peft and frozen: [base] (full fine-tuning)")
    for part in ("optimizer", "activations"):
        if getattr(recipe.offload, part):
            raise RecipeError(f"neither engine offloads: the {part} stays on the device", field=f"offload.{part}",
                              value=True, fix=f"set offload.{part}=false (`muse-stack plan` then counts it on the device)")
    if recipe.engine == "reference":
        lay = recipe.layout
        split = {k: v for k, v in (("tp", lay.tp), ("pp", lay.pp), ("cp", lay.cp or 1), ("ep", lay.ep or 1),
                                   ("etp", lay.etp), ("vpp", lay.vpp or 1)) if v > 1}
        if split:
            name = next(iter(split))
            raise RecipeError("the reference engine is data-parallel only: every process holds the whole model",
                              field=f"layout.{name}", value=split[name],
                              fix=f"set layout.{name}=1 (the processes become data-parallel replicas), "
                                  "or use engine: megatron")
        if recipe.training.async_checkpoint:
            raise RecipeError("the reference engine saves checkpoints synchronously", field="training.async_checkpoint",
                              value=True, fix="set training.async_checkpoint=false, or use engine: megatron")
        if recipe.recompute.granularity not in (None, "none"):
            raise RecipeError("the reference engine keeps every activation; it does not recompute",
                              field="recompute.granularity", value=recipe.recompute.granularity,
                              fix="unset recompute.granularity, or use engine: megatron")
    if recipe.engine == "megatron":
        from muse_stack.engines.mcore.config import transformer_config_kwargs

        transformer_config_kwargs(recipe, recipe.model_config_resolved())
        frozen = [f for f in recipe.frozen if f not in TOWERS]
        if frozen:
            raise RecipeError("the megatron engine trains every decoder parameter; it does not freeze modules",
                              field="frozen", value=frozen,
                              fix="drop them from frozen, or use engine: reference, which freezes by parameter name")
