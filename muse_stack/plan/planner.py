"""`muse-stack plan`: everything a user must know before queueing the GPUs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from muse_stack.machine.hardware import gpu_spec
from muse_stack.plan.cost import StepKernels, StepTime, TimeCalibration, estimate_step
from muse_stack.plan.fabrics import Links
from muse_stack.recipes.layout import pack_alignment
from muse_stack.plan.memory import Calibration, StageMemory, estimate
from muse_stack.resolve.rules import RuleReport, check
from muse_stack.plan.save import SaveTime, save_time
from muse_stack.plan.used import UsedMemory, used_memory
from muse_stack.recipes.completeness import unstated_training_values
from muse_stack.recipes.engines import traits
from muse_stack.models.muse_spark.peft_config import adapter_params_per_layer
from muse_stack.resolve.recipe import ResolvedRecipe, finalize
from muse_stack.recipes.schema import Recipe


class Plan(BaseModel):
    recipe: str
    world_size: int
    gpu: str
    nodes: int
    tp: int
    pp: int
    cp: int | None
    ep: int | None
    etp: int
    dp: int | None
    expert_dp: int | None
    sequence_parallel: bool | None
    stages: list[int] | None
    stage_holds: dict[int, list[str]]
    microbatches_per_replica: int | None
    tokens_per_step: int | None
    steps_per_epoch: int | None
    steps: int | None
    experts_per_ep_rank: float | None
    pack_alignment: int
    memory: list[StageMemory]
    peak_stage: int | None
    peak_memory_gib: float | None
    gpu_memory_gib: float | None
    fits: bool | None
    calibration: Calibration
    unchecked: list[str]
    assumptions: list[str]
    unstated_training: list[str] = []  # optimizer values run and launch refuse until the recipe states them
    active_params: int
    total_params: int
    used: UsedMemory | None = None  # peak stage's memory as nvidia-smi sees it
    time: StepTime | None = None
    time_unavailable: str | None = None  # why there is no step-time estimate
    save: SaveTime | None = None  # the planned synchronous checkpoint save per rank (plan/save.py)

    @property
    def fits_used(self) -> bool | None:
        """Whether the expected used memory fits the GPU."""
        if self.used is None or self.gpu_memory_gib is None:
            return None
        return self.used.used_gib <= self.gpu_memory_gib
    #: the resolved adapters (values the recipe leaves unstated filled from the documented table)
    peft: dict[str, Any] | None = None
    adapter_params: int | None = None  #: adapter parameters of the whole model

    def summary(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def make_plan(recipe: Recipe | ResolvedRecipe, gpus: int | None = None, calibration: Calibration | None = None,
              strict: bool = True, time_calibration: TimeCalibration | None = None,
              seq_lens: list[int] | None = None, links: Links | None = None,
              kernels: StepKernels | None = None) -> tuple[Plan, RuleReport]:
    """Validate and plan a recipe (or one :func:`~muse_stack.resolve.recipe.finalize` gave, for its
    GPUs). With ``strict`` a broken layout raises the first :class:`LayoutError` (all of them are in
    its message). ``kernels``: the engine's kernel choices the step time prices (default: those the
    engine makes for the recipe, :func:`muse_stack.plan.cost.step_kernels`)."""
    if isinstance(recipe, ResolvedRecipe):
        resolved = recipe if gpus is None or gpus == recipe.world else finalize(recipe.recipe, gpus=gpus)
    else:
        resolved = finalize(recipe, gpus=gpus)  # a GPU count out of range is refused there, naming --gpus
    recipe, model, peft, world = resolved.recipe, resolved.model, resolved.peft, resolved.world
    cal = calibration or Calibration()
    report = check(recipe, model, world)
    if strict:
        report.raise_errors()
    lay, batch = recipe.layout, recipe.batch
    dp, edp, micro = resolved.dp, resolved.expert_dp, resolved.micro_batches
    stages = list(resolved.stages) if resolved.stages is not None else None
    tokens = batch.gbs * batch.seq_length if batch.gbs and batch.seq_length else None
    packs = recipe.data.packs or recipe.data.rows
    steps_per_epoch = packs // batch.gbs if packs and batch.gbs else None
    assumptions = list(report.assumptions)
    if lay.distributed_optimizer is None:
        assumptions.append("layout.distributed_optimizer is not stated; the memory estimate assumes it on")
    from muse_stack.plan.towers import tower_plan

    towers = tower_plan(resolved)
    if towers is not None:  # where the perception towers sit, what of them trains, what they compute
        assumptions.extend(towers.describe())
    if batch.mbs is None or batch.seq_length is None:
        report.unchecked.append("activation memory: batch.mbs or batch.seq_length is not stated")
    missing = [f"layout.{k}" for k in ("ep", "cp") if getattr(lay, k) is None]
    if missing:
        report.unchecked.append(f"memory: {', '.join(missing)} not stated (pass {missing[0]}=N)")
    memory = estimate(resolved, world, stages, dp, edp, micro, cal) if stages and not missing else []
    spec = gpu_spec(recipe.hardware.gpu)
    gpu_mem = recipe.hardware.memory_gib or (spec.memory_gib if spec else None)
    totals = [m.total_gib for m in memory if m.total_gib is not None]
    peak = max(totals) if totals and len(totals) == len(memory) else None
    peak_stage = next((m.stage for m in memory if m.total_gib == peak), None) if peak is not None else None
    steps = recipe.training.steps
    if steps is None and recipe.training.epochs and steps_per_epoch:
        steps = int(recipe.training.epochs * steps_per_epoch)
    plan = Plan(
        recipe=recipe.name, world_size=world, gpu=recipe.hardware.gpu,
        nodes=-(-world // recipe.hardware.per_node), tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, etp=lay.etp,
        dp=dp, expert_dp=edp,
        sequence_parallel=lay.sequence_parallel if lay.sequence_parallel is not None else (True if lay.tp > 1 else None),
        stages=stages, stage_holds={m.stage: m.holds for m in memory if m.holds},
        microbatches_per_replica=micro, tokens_per_step=tokens, steps_per_epoch=steps_per_epoch, steps=steps,
        experts_per_ep_rank=model.num_local_experts / lay.ep if lay.ep else None,
        pack_alignment=pack_alignment(lay), memory=memory, peak_stage=peak_stage, peak_memory_gib=peak,
        gpu_memory_gib=gpu_mem, fits=(peak <= gpu_mem * (1 - cal.headroom_fraction)) if peak is not None and gpu_mem else None,
        calibration=cal, unchecked=report.unchecked, assumptions=assumptions,
        unstated_training=unstated_training_values(recipe),
        active_params=model.active_params, total_params=model.total_params,
        peft=peft.as_dict() if peft else None,
        adapter_params=sum(adapter_params_per_layer(peft, model)) * model.num_hidden_layers if peft else None,
    )
    if peak is not None and dp and edp:
        plan.used = used_memory(peak, tp=lay.tp, pp=lay.pp, cp=lay.cp or 1, ep=lay.ep or 1, etp=lay.etp, dp=dp, edp=edp)
    plan.time, plan.time_unavailable = _step_time(resolved, world, stages, dp, edp, micro, memory,
                                                  time_calibration, seq_lens, links, kernels)
    plan.save = save_time(memory)
    return plan, report


def _step_time(resolved: ResolvedRecipe, world: int, stages: list[int] | None, dp: int | None, edp: int | None,
               micro: int | None, memory: list[StageMemory], cal: TimeCalibration | None,
               seq_lens: list[int] | None, links: Links | None = None,
               kernels: StepKernels | None = None) -> tuple[StepTime | None, str | None]:
    recipe = resolved.recipe
    spec = gpu_spec(recipe.hardware.gpu)
    if spec is None:
        return None, f"no GPU figures for {recipe.hardware.gpu} in the machine table (muse_stack/machine/machines.yaml)"
    if not traits(recipe.engine).step_time_model:
        return None, f"the step-time model is of megatron-core; the recipe's engine is {recipe.engine}"
    lay, batch = recipe.layout, recipe.batch
    missing = [f for f, v in (("batch.mbs", batch.mbs), ("batch.gbs", batch.gbs), ("batch.seq_length", batch.seq_length),
                              ("layout.cp", lay.cp), ("layout.ep", lay.ep)) if v is None]
    if missing:
        return None, f"{', '.join(missing)} not stated (pass e.g. {missing[0]}=N)"
    if not (stages and dp and micro and memory):
        return None, "the layout does not resolve (see the rules above)"
    params = []
    for m in memory:
        share = m.trainable_params / m.params if m.params else 0.0
        params.append((int(m.dense_params * share), int(m.expert_params * share)))
    return estimate_step(resolved, spec, world, stages, dp, edp, micro, params, cal, seq_lens, links,
                         kernels), None
