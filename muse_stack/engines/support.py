"""Recipe rules the engines share: the towers a recipe may freeze, what megatron-core's
precision-aware optimizer needs and the optimizer state it keeps, and every training value stated
before an engine builds its optimizer. The whole check of a recipe against its engine is
:meth:`muse_stack.resolve.recipe.ResolvedRecipe.validate`.
"""

from __future__ import annotations

from muse_stack.util.errors import RecipeError
from muse_stack.recipes.completeness import check_recipe_values, unstated_training_values
from muse_stack.recipes.schema import Recipe

__all__ = ["TOWERS", "check_precision_aware", "check_recipe_values", "optimizer_state_bytes", "require_stated",
           "unstated_training_values"]

#: the perception towers a recipe may freeze by name: the reference engine freezes their parameters
#: (``model.<tower>.*``) when the model has them; a text model has none, so freezing them holds
TOWERS = ("vision_tower", "audio_tower")


def require_stated(recipe: Recipe) -> None:
    """What each engine calls before it builds its optimizer: every value it uses is stated."""
    check_recipe_values(recipe)


def check_precision_aware(recipe: Recipe) -> None:
    """``optimizer.precision_aware`` / ``param_remainders``: what megatron-core's precision-aware
    optimizer needs, refused here with the field rather than by an assertion inside megatron-core."""
    opt, lay = recipe.optimizer, recipe.layout
    if not opt.precision_aware:
        if opt.param_remainders:
            raise RecipeError("optimizer.param_remainders keeps the master weights inside TE's FusedAdam, which "
                              "only the precision-aware optimizer does", field="optimizer.param_remainders",
                              value=True, fix="set optimizer.precision_aware=true, or drop optimizer.param_remainders")
        return
    if lay.distributed_optimizer is False:
        raise RecipeError("the precision-aware optimizer is megatron-core's distributed optimizer's",
                          field="layout.distributed_optimizer", value=False,
                          fix="set layout.distributed_optimizer=true, or drop optimizer.precision_aware")
    if opt.name == "sgd":
        raise RecipeError("the precision-aware optimizer is TE's FusedAdam", field="optimizer.name", value="sgd",
                          fix="use adam, or drop optimizer.precision_aware")
    if recipe.peft is not None:
        raise RecipeError("the precision-aware optimizer has not been run with adapters on this engine",
                          field="optimizer.precision_aware", value=True,
                          fix="set optimizer.precision_aware=false (megatron-core's own fp32 master shards) for a "
                              "peft recipe")
    if opt.param_remainders is None:
        raise RecipeError("with optimizer.precision_aware the master weights' storage must be stated: it decides "
                          "how the bf16 weights round", field="optimizer.param_remainders", value=None,
                          fix="set optimizer.param_remainders=true (bf16 weight + int16 remainder, 2 bytes per "
                              "parameter less) or false (a separate fp32 master)")
    if opt.param_remainders and recipe.precision != "bf16":
        raise RecipeError("int16 remainders complete a bf16 weight to its fp32 master; under this precision there "
                          "is no bf16 weight", field="optimizer.param_remainders", value=True,
                          fix="set optimizer.param_remainders=false, or precision: bf16")


def optimizer_state_bytes(recipe: Recipe) -> int:
    """Optimizer state per trainable parameter, as megatron-core keeps it (and as a dist-checkpoint
    holds it): Adam's two fp32 moments, plus an fp32 master copy of each bf16 weight (an int16
    remainder under ``optimizer.param_remainders``); SGD keeps the master copy only."""
    if recipe.optimizer.name == "sgd":
        return 0 if recipe.precision == "fp32" else 4
    if recipe.precision == "fp32":
        return 8
    return 10 if recipe.optimizer.precision_aware and recipe.optimizer.param_remainders else 12
