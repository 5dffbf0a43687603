"""Is a recipe complete? The optimizer values that change training must each be stated (or filled
by a named fill policy, :mod:`muse_stack.recipes.fill`) before a run or a launch; the planner
lists the ones still missing."""

from __future__ import annotations

from muse_stack.util.errors import RecipeError
from muse_stack.recipes.schema import Recipe


def unstated_training_values(recipe: Recipe) -> list[str]:
    """The optimizer fields that change training and that the recipe leaves unstated. Neither
    engine fills them in: a run or launch is refused until the recipe states each one."""
    opt = recipe.optimizer
    missing = [f for f in ("name", "lr", "decay_style", "weight_decay", "clip_grad") if getattr(opt, f) is None]
    if opt.decay_style != "constant" and opt.min_lr is None:  # an unstated style may decay: asked in one round
        missing.append("min_lr")
    if opt.warmup_steps is None and opt.warmup_fraction is None:
        missing.append("warmup_steps")
    if opt.name in ("adam", "adamw"):
        missing += [f for f in ("beta1", "beta2", "eps") if getattr(opt, f) is None]
    return [f"optimizer.{f}" for f in missing]


def check_recipe_values(recipe: Recipe) -> None:
    missing = unstated_training_values(recipe)
    if missing:
        example = {"optimizer.lr": "3e-4", "optimizer.decay_style": "cosine", "optimizer.weight_decay": "0.1",
                   "optimizer.clip_grad": "1.0", "optimizer.min_lr": "3e-5", "optimizer.warmup_steps": "5",
                   "optimizer.beta1": "0.9", "optimizer.beta2": "0.95", "optimizer.eps": "1e-8",
                   "optimizer.name": "adamw"}
        raise RecipeError(f"the recipe leaves {len(missing)} value{'s' if len(missing) > 1 else ''} that change "
                          f"training unstated: {', '.join(missing)}; neither engine fills them in",
                          field=missing[0], value=None,
                          rule="every optimizer setting that changes training is stated (clip_grad 0 = no clipping, "
                               "warmup_steps 0 = no warmup)",
                          fix="state them in the recipe or as overrides, e.g. "
                              + " ".join(f"{m}={example[m]}" for m in missing[:4]) + (" ..." if len(missing) > 4 else ""))
