"""A recipe resolved and validated once: what every command and engine reads instead of deriving it.

Shaped as Megatron-Bridge's ``ConfigContainer``: :func:`finalize` derives what the recipe implies
(the model configuration, the perception towers, the adapters with their unstated values filled,
the data-parallel sizes, the pipeline split and the micro-batches per step), and
:meth:`ResolvedRecipe.validate` makes every check an engine would make when it starts, so a recipe
it would refuse is refused before anything is written or allocated, naming the field and the fix.
:func:`resolve` is both. ``run`` (and ``--dry-run``), ``launch`` and ``list`` refuse what
``validate`` refuses; ``plan`` and ``tune`` plan the finalized object and ``plan`` says what
``run`` would refuse.

The recipe itself (:class:`~muse_stack.recipes.schema.Recipe`) checks each value and what one
recipe says of itself; what an engine can run is checked here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes.layout import data_parallel, expert_data_parallel, micro_batches, stage_layers
from muse_stack.models.muse_spark.peft_config import DEFAULTS, DEFAULTS_SOURCE, PeftSettings
from muse_stack.recipes.schema import FP8_RECIPE_ARCHS, MAX_GPUS, FilledValue, Fp8, Recipe
from muse_stack.util.errors import LayoutError, MuseStackError, RecipeError


@dataclass(frozen=True)
class ResolvedRecipe:
    """A recipe and everything it resolves to, for ``world`` GPUs (or CPU processes)."""

    recipe: Recipe  #: with its filled values and their sources (``recipe.filled``); read, never changed
    model: ModelConfig
    towers: Any  #: the perception towers (muse_stack.models.muse_spark.tower_config.TowersConfig), None for text
    peft: PeftSettings | None  #: the adapters, unstated values filled from peft_config.DEFAULTS
    world: int
    dp: int | None  #: data-parallel replicas: world / (TP x PP x CP); None where it does not resolve
    expert_dp: int | None  #: world / (EP x ETP x PP)
    stages: tuple[int, ...] | None  #: decoder layers per pipeline stage
    #: micro-batches per replica per step, GBS / (MBS x DP); None where a size is unstated or does not split
    micro_batches: int | None

    @property
    def filled(self) -> dict[str, FilledValue]:
        """Every value the recipe leaves unstated and something filled, with its source: the fill
        policy's (``recipe.filled``) and the adapters' defaults."""
        out = dict(self.recipe.filled)
        if self.peft is not None:
            for name in DEFAULTS:
                if getattr(self.recipe.peft, name) is None:
                    out[f"peft.{name}"] = FilledValue(value=getattr(self.peft, name), source=DEFAULTS_SOURCE)
        return out

    def with_layout(self, recipe: Recipe, *, gpus: int | None = None) -> "ResolvedRecipe":
        """``recipe``, this recipe with another layout, micro-batch size or recompute (a layout search's
        candidate), resolved: the model, towers and adapters kept, the layout's facts derived again."""
        return _with_layout(recipe, self.model, self.towers, self.peft, gpus)

    def validate(self, *, values: bool = True) -> "ResolvedRecipe":
        """Raise what the recipe's engine would refuse when it starts (``values=False``: all but the
        unstated optimizer values, which `run` checks after the machine, so a machine that cannot
        run the recipe says so first); returns itself."""
        _validate(self, values=values)
        return self

    def refusal(self, *, values: bool = True) -> MuseStackError | None:
        """What :meth:`validate` would raise, or None."""
        try:
            _validate(self, values=values)
        except (RecipeError, LayoutError) as exc:
            return exc
        return None


def finalize(recipe: Recipe, *, gpus: int | None = None) -> ResolvedRecipe:
    """Derive what ``recipe`` implies on ``gpus`` GPUs (default: ``hardware.count``). Raises only
    what cannot be derived: model overrides that give no valid model, towers that do not fit the
    decoder, adapters on targets the model lacks."""
    if gpus is not None and not (isinstance(gpus, int) and 1 <= gpus <= MAX_GPUS):
        raise LayoutError("the GPU count is out of range", field="--gpus", value=gpus,
                          rule=f"1 <= GPUs <= {MAX_GPUS:,}",
                          fix="give --gpus 1 or more (or leave it out for the recipe's hardware.count)")
    model = recipe.model.resolve()
    towers = recipe.towers_config_resolved(model)
    peft = None
    if recipe.peft is not None:
        from muse_stack.models.muse_spark.peft_config import resolve as resolve_peft

        peft = resolve_peft(recipe.peft, model)  # a target the model lacks is refused here, by name
    return _with_layout(recipe, model, towers, peft, gpus)


def _with_layout(recipe: Recipe, model: ModelConfig, towers: Any, peft: PeftSettings | None,
                 gpus: int | None) -> ResolvedRecipe:
    world = gpus if gpus is not None else recipe.hardware.count
    lay, batch = recipe.layout, recipe.batch
    dp = data_parallel(world, lay)
    stages = stage_layers(lay, model.num_hidden_layers)
    return ResolvedRecipe(recipe=recipe, model=model, towers=towers, peft=peft, world=world, dp=dp,
                          expert_dp=expert_data_parallel(world, lay),
                          stages=tuple(stages) if stages is not None else None,
                          micro_batches=micro_batches(batch.gbs, batch.mbs, dp))


def resolve(recipe: Recipe, *, gpus: int | None = None, values: bool = True) -> ResolvedRecipe:
    """:func:`finalize`, then :meth:`ResolvedRecipe.validate`: the recipe as its engine would train it,
    or the error naming what it would refuse."""
    return finalize(recipe, gpus=gpus).validate(values=values)


# ---- the checks -------------------------------------------------------------------------
def _validate(r: ResolvedRecipe, *, values: bool) -> None:
    from muse_stack.util import numerics
    from muse_stack.engines.spec import engine_spec
    from muse_stack.recipes.engines import refuse_fields_of_other_engines

    recipe = r.recipe
    refuse_fields_of_other_engines(recipe)
    _check_fp8(recipe)
    numerics.check(recipe)
    if recipe.peft is None and "base" in recipe.frozen:
        raise RecipeError("frozen: [base] freezes the whole model, which leaves nothing to train without adapters",
                          field="frozen", value=recipe.frozen, fix="add a peft block, or drop base from frozen")
    for part in ("optimizer", "activations"):
        if getattr(recipe.offload, part):
            raise RecipeError(f"neither engine offloads: the {part} stays on the device", field=f"offload.{part}",
                              value=True,
                              fix=f"set offload.{part}=false (`muse-stack plan` then counts it on the device)")
    _check_warmup(recipe)
    _check_token_ids(r)
    engine_spec(recipe.engine).check(r)
    _check_stated(r)
    _check_layout(r)
    from muse_stack.data.split import check_stated

    check_stated(recipe)  # a validation section with a value unstated
    if values:
        from muse_stack.recipes.completeness import check_recipe_values

        check_recipe_values(recipe)


def _check_fp8(recipe: Recipe) -> None:
    """``precision: fp8``: both settings stated, and what Transformer Engine and megatron-core run."""
    from muse_stack.machine.hardware import gpu_spec

    if recipe.precision != "fp8":
        if recipe.fp8 is not None:
            raise RecipeError("fp8 settings without precision: fp8", field="fp8", value=recipe.fp8.model_dump(),
                              fix="set precision=fp8, or drop the fp8 block")
        return
    settings = recipe.fp8 or Fp8()
    for key, example in (("recipe", "tensorwise"), ("format", "hybrid")):
        if getattr(settings, key) is None:
            raise RecipeError(f"precision: fp8 needs fp8.{key} stated: it changes training", field=f"fp8.{key}",
                              value=None, fix=f"state it, e.g. fp8.{key}={example}")
    if settings.recipe == "delayed" and recipe.recompute.granularity == "full":
        raise RecipeError("fp8.recipe delayed with full recompute would update the amax history twice per "
                          "step (the recomputed forward counts again)", field="fp8.recipe", value="delayed",
                          fix="use fp8.recipe=tensorwise with full recompute, or recompute.granularity=none")
    spec = gpu_spec(recipe.hardware.gpu)
    arch = spec.arch if spec is not None else "cpu"
    allowed = FP8_RECIPE_ARCHS[settings.recipe]
    if arch not in allowed:
        raise RecipeError(f"fp8.recipe {settings.recipe} needs a GPU of {' or '.join(allowed)}; "
                          f"{recipe.hardware.gpu} is {arch}", field="fp8.recipe", value=settings.recipe,
                          fix="mxfp8 on Blackwell (B200, GB200); tensorwise, delayed or blockwise on Hopper")


def _check_warmup(recipe: Recipe) -> None:
    """One warm-up: a stated ``warmup_steps`` would silently win over a stated ``warmup_fraction``
    (Bridge's ``scheduler.lr_warmup_iters`` and ``scheduler.lr_warmup_fraction``). The fill policy never
    joins a stated fraction with steps, so both set is what the recipe and its overrides say."""
    opt = recipe.optimizer
    if opt.warmup_steps is not None and opt.warmup_fraction is not None:
        raise RecipeError(f"the warm-up is stated twice: optimizer.warmup_steps = {opt.warmup_steps} and "
                          f"optimizer.warmup_fraction = {opt.warmup_fraction} (scheduler.lr_warmup_fraction); "
                          "only one can apply", field="optimizer.warmup_fraction", value=opt.warmup_fraction,
                          rule="a warm-up is stated as steps or as a fraction of training.steps, not both",
                          fix="keep one: drop the other from the recipe, or pass optimizer.warmup_steps=null with "
                              "the fraction (optimizer.warmup_fraction=null with the steps)")


def _check_token_ids(r: ResolvedRecipe) -> None:
    """The special-token ids index the model's embedding: an id at or above ``vocab_size`` (or below 0)
    names a row the embedding does not have."""
    model = r.model
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(model, name)
        ids = value if isinstance(value, list) else [value]
        bad = [i for i in ids if i is not None and not 0 <= i < model.vocab_size]
        if bad:
            raise RecipeError(f"{name} {bad[0]} is not an id of the model's vocabulary (0 to {model.vocab_size - 1})",
                              field=f"model.overrides.{name}", value=value,
                              rule="a special token's id below model.overrides.vocab_size",
                              fix=f"give the tokenizer's {name.split('_')[0]} id, below {model.vocab_size}, or raise "
                                  "model.overrides.vocab_size to the tokenizer's size")


def _value(recipe: Recipe, path: str) -> Any:
    section, key = path.split(".")
    return getattr(getattr(recipe, section), key)


def _check_stated(r: ResolvedRecipe) -> None:
    """The sizes the recipe's engine starts from are stated: it fills none in, and each changes training
    (the batch) or what each GPU holds (the layout)."""
    from muse_stack.recipes.engines import traits

    recipe = r.recipe
    missing = [f for f in traits(recipe.engine).stated if _value(recipe, f) is None]
    if not missing:
        return
    note = recipe.notes.get(missing[0])
    them = "them" if len(missing) > 1 else "it"
    stated = traits(recipe.engine).stated
    split = ""
    if "batch.gbs" in missing:  # the global batch splits into MBS x DP sequences a micro-step
        mbs = recipe.batch.mbs
        split = " (batch.gbs a multiple of batch.mbs x DP" + (
            f" = {mbs} x {r.dp} = {mbs * r.dp})" if r.dp is not None and mbs is not None
            else f", DP = {r.dp})" if r.dp is not None else ")")
    raise RecipeError(
        f"the recipe leaves {', '.join(missing)} unstated{f' ({note})' if note else ''}; the {recipe.engine} "
        f"engine needs {them} and fills none in", field=missing[0], value=None,
        rule=f"the {recipe.engine} engine starts from {', '.join(stated)}, each stated (they change training "
             "or what each GPU holds)",
        fix=f"state {them} in the recipe, or pass {them} on the command line: " + " ".join(f"{f}=N" for f in missing)
            + split)


def _check_layout(r: ResolvedRecipe) -> None:
    """megatron-core's layout rules (:mod:`muse_stack.resolve.rules`), the global batch's split among them."""
    from muse_stack.resolve.rules import check

    check(r.recipe, r.model, r.world).raise_errors()

