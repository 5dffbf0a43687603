"""What the engines can train, checked on the recipe before a run writes anything.

A recipe can ask for more than an engine does; those requests are refused here, naming the
field, rather than trained differently from what the recipe says.
"""

from __future__ import annotations

from muse_stack.errors import RecipeError
from muse_stack.recipes.schema import Recipe

#: the perception towers a recipe may freeze by name: the reference engine freezes their parameters
#: (``model.<tower>.*``) when the model has them; a text model has none, so freezing them holds
TOWERS = ("vision_tower", "audio_tower")


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


def require_stated(recipe: Recipe) -> None:
    """What each engine calls before it builds its optimizer: every value it uses is stated."""
    check_recipe_values(recipe)


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


def check_recipe(recipe: Recipe, *, values: bool = True) -> None:
    """Raise a RecipeError for anything the recipe's engine would not train as written
    (``values=False``: all but the unstated optimizer values and the towers the megatron engine
    does not place, which `run` checks after the machine, so a machine that cannot run the recipe
    says so first)."""
    from muse_stack.run import numerics

    numerics.check(recipe)
    if recipe.data.kind == "multimodal" or recipe.model.towers is not None:
        recipe.towers_config_resolved()  # the towers are valid and fit the decoder
    if recipe.peft is not None:
        from muse_stack.recipes.peft import resolve

        settings = resolve(recipe.peft, recipe.model_config_resolved())
        if recipe.engine == "megatron" and settings.expert_targets and recipe.layout.etp > 1:
            raise RecipeError("the megatron engine's expert adapters are whole on every expert-tensor-parallel "
                              "rank; it does not split them over ETP", field="layout.etp", value=recipe.layout.etp,
                              fix="set layout.etp=1 (and raise layout.ep), or drop "
                                  + ", ".join(settings.expert_targets) + " from peft.targets")
    elif "base" in recipe.frozen:
        raise RecipeError("frozen: [base] freezes the whole model, which leaves nothing to train without adapters",
                          field="frozen", value=recipe.frozen, fix="add a peft block, or drop base from frozen")
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
        check_precision_aware(recipe)
        # with adapters the whole base is frozen (frozen: [base]); the engine freezes nothing else
        frozen = [f for f in recipe.frozen if f not in TOWERS and not (recipe.peft is not None and f == "base")]
        if frozen:
            raise RecipeError("the megatron engine trains every decoder parameter; it does not freeze modules",
                              field="frozen", value=frozen,
                              fix="drop them from frozen, or use engine: reference, which freezes by parameter name")
    if values:
        check_towers_placed(recipe)
        check_recipe_values(recipe)


def check_towers_placed(recipe: Recipe) -> None:
    """The perception towers train on the reference engine only: the megatron engine builds the
    text decoder and does not place the towers on its first pipeline stage yet."""
    if recipe.engine == "megatron" and (recipe.data.kind == "multimodal" or recipe.model.towers is not None):
        raise RecipeError("the megatron engine does not place the vision and audio towers yet (it builds the text "
                          "decoder only); the reference engine trains them with the decoder",
                          field="engine", value="megatron",
                          fix="`muse-stack plan` counts the towers for this recipe; to train them, use engine: "
                              "reference (`muse-stack run tiny-cpu-mm` trains a toy model with both towers on this "
                              "CPU); or train on text data (data.kind: sft)")


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
