"""`muse-stack tune`: search layouts within the memory plan's fit for the fastest predicted step.

The search varies TP, PP (with the first and last stage sizes), EP, ETP, CP, VPP, MBS and the
recompute setting of a recipe, keeps the global batch, sequence length, data and optimizer as
the recipe states them, plans each candidate (rules, memory, expected used memory, step time)
and ranks those whose rules pass and whose expected used memory fits the GPU by predicted
tokens/s per GPU. The best is written as the override list `run` and `launch` take.

Sizes are every value the layout rules can accept, not powers of two only: TP every divisor of
the attention and KV head counts (within a node), PP every divisor of the GPUs up to the layer
count, EP every divisor of the experts, ETP every divisor of TP, CP every divisor of the KV heads
per TP rank (what the a2a exchange splits). What the search bounds rather than enumerates is
listed by :func:`bounds` and printed with its result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pydantic import BaseModel

from muse_stack.util.errors import LayoutError
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes.layout import micro_batches
from muse_stack.plan.planner import make_plan
from muse_stack.resolve.recipe import finalize
from muse_stack.recipes.schema import Recipe

RECOMPUTE: list[tuple[str, list[str] | None]] = [
    ("none", None), ("selective", ["core_attn"]), ("selective", ["moe_act"]), ("selective", ["moe"]), ("full", None)]


class Candidate(BaseModel):
    label: str
    overrides: list[str]
    tokens_per_s_per_gpu: float
    step_s: float
    used_gib: float
    allocated_gib: float
    dominant: str
    dominant_s: float


def _divisors(n: int, upto: int | None = None) -> list[int]:
    """The divisors of ``n`` (at most ``upto``), ascending."""
    limit = n if upto is None else min(n, upto)
    return [d for d in range(1, limit + 1) if n % d == 0]


#: the micro-batch sizes and virtual pipeline sizes tried
MBS = (1, 2)
VPP = (1, 2)


def bounds(recipe: Recipe) -> list[str]:
    """What the search does not enumerate although the rules may accept it, one line each."""
    per_node = recipe.hardware.per_node
    return [f"TP above the {per_node} GPUs of a node (tensor parallelism stays within NVLink)",
            f"micro-batch sizes above {max(MBS)}",
            f"virtual pipeline sizes above {max(VPP)} (VPP {max(VPP)} only where the layers split evenly "
            f"over 2 x PP)",
            "uneven pipeline splits other than equal first and last stages within two layers of the middle ones",
            "recompute settings other than none, full, and selective of one module group "
            f"({', '.join(m[0] for g, m in RECOMPUTE if m)})",
            "CP with a comm type other than a2a"]


def stage_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None]]:
    """(first, last) stage sizes to try: an even split when the layers divide, and equal first
    and last stages within two layers of the middle stages."""
    if pp == 1:
        return [(None, None)]
    out: list[tuple[int | None, int | None]] = []
    if num_layers % pp == 0:
        out.append((None, None))
    if pp > 2:
        for f in range(1, num_layers // 2):
            rest = num_layers - 2 * f
            if rest > 0 and rest % (pp - 2) == 0 and abs(rest // (pp - 2) - f) <= 2 and (rest // (pp - 2)) != f:
                out.append((f, f))
    return out


class Layout(BaseModel):
    """One candidate: the fields it sets, and the same as overrides."""

    layout: dict
    mbs: int
    granularity: str
    modules: list[str] | None

    def overrides(self) -> list[str]:
        def v(x):
            if x is None:
                return "null"
            if isinstance(x, bool):
                return "true" if x else "false"
            if isinstance(x, list):
                return "[" + ",".join(str(i) for i in x) + "]"
            return str(x)

        ov = [f"layout.{k}={v(x)}" for k, x in self.layout.items()]
        return [*ov, f"batch.mbs={self.mbs}", f"recompute.granularity={self.granularity}",
                f"recompute.modules={v(self.modules)}"]

    def label(self, stages: list[int] | None) -> str:
        lay = self.layout
        split = ""
        if stages and len(set(stages)) > 1:
            split = f" ({stages[0]}+{len(stages) - 2}x{stages[1]}+{stages[-1]})"
        rec = self.granularity + (f" {','.join(self.modules)}" if self.modules else "")
        vpp = f" VPP{lay['vpp']}" if lay["vpp"] > 1 else ""
        return (f"TP{lay['tp']} PP{lay['pp']}{split}{vpp} CP{lay['cp']} EP{lay['ep']} ETP{lay['etp']} DP{lay['dp']} "
                f"MBS{self.mbs} recompute {rec}")


def candidates(recipe: Recipe, world: int, model: ModelConfig | None = None) -> Iterator[Layout]:
    """The layouts of ``recipe`` on ``world`` GPUs the search plans (``model``: the recipe's model
    configuration, where the caller has it)."""
    model = model or finalize(recipe).model
    experts, heads = model.num_local_experts, model.num_key_value_heads
    gbs, seq = recipe.batch.gbs, recipe.batch.seq_length
    per_node = recipe.hardware.per_node
    import math

    for tp in _divisors(math.gcd(model.num_attention_heads, heads), per_node):
        for pp in _divisors(world, model.num_hidden_layers):
            for cp in _divisors(heads // tp) if heads % tp == 0 else [1]:
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                for etp in _divisors(tp):
                    for ep in _divisors(experts):
                        if world % (ep * etp * pp):
                            continue
                        for first, last in stage_splits(model.num_hidden_layers, pp):
                            even = first is None and pp > 1 and model.num_hidden_layers % (2 * pp) == 0
                            for vpp in (VPP if even else (1,)):
                                for mbs in MBS:
                                    if micro_batches(gbs, mbs, dp) is None or (cp > 1 and seq % (2 * cp)):
                                        continue
                                    for gran, modules in RECOMPUTE:
                                        yield Layout(layout={
                                            "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "dp": dp, "vpp": vpp,
                                            "sequence_parallel": tp > 1, "pp_layers": None,
                                            "first_stage_layers": first, "last_stage_layers": last,
                                            "cp_comm_type": "a2a" if cp > 1 else None,
                                            # the recipe's own words about its layout no longer hold
                                            "label": None, "summary": None, "highlights": None},
                                            mbs=mbs, granularity=gran, modules=modules)


def apply(recipe: Recipe, overrides: list[str]) -> Recipe:
    """The recipe with ``overrides`` applied the way `run` and `launch` apply them."""
    from muse_stack.recipes.catalogue import parse_recipe
    from muse_stack.recipes.overrides import apply_overrides

    return parse_recipe(apply_overrides(recipe.model_dump(mode="json"), overrides), recipe.name)


def _check_predictable(recipe: Recipe) -> None:
    """Tune ranks layouts by the planner's predicted step time, which needs the GPU's figures in the
    machine table and the engine the step-time model is of; a recipe without either has no layout to
    rank, whatever its memory or rules (a CPU recipe: the reference engine on ``hardware.gpu: cpu``)."""
    from muse_stack.machine.hardware import gpu_spec, gpus
    from muse_stack.recipes.engines import traits

    if gpu_spec(recipe.hardware.gpu) is None:
        raise LayoutError(f"tune ranks layouts by their predicted step time, and the machine table has no GPU "
                          f"figures for {recipe.hardware.gpu} to predict one (muse_stack/machine/machines.yaml)",
                          field="hardware.gpu", value=recipe.hardware.gpu,
                          fix=f"tune a GPU recipe, or this one on a GPU type: --gpu {next(iter(gpus()))} "
                              f"engine=megatron (one of {', '.join(gpus())})")
    if not traits(recipe.engine).step_time_model:
        raise LayoutError(f"tune ranks layouts by their predicted step time, whose model is of megatron-core; the "
                          f"{recipe.engine} engine has none (and runs every layout size 1)", field="engine",
                          value=recipe.engine, fix="tune the recipe with engine=megatron")


def search(recipe: Recipe, world: int | None = None, progress: Callable[[int, int], None] | None = None,
           top: int = 5) -> tuple[list[Candidate], int]:
    """(the ``top`` candidates that fit, fastest first; how many layouts were planned)."""
    world = world or recipe.hardware.count
    if recipe.batch.gbs is None or recipe.batch.seq_length is None:
        raise LayoutError("tune needs the global batch and the sequence length", field="batch.gbs",
                          value=recipe.batch.gbs, fix="state batch.gbs and batch.seq_length in the recipe")
    _check_predictable(recipe)
    resolved = finalize(recipe, gpus=world)
    todo = list(candidates(recipe, world, resolved.model))
    found: list[Candidate] = []
    for j, cand in enumerate(todo):
        if progress and j % 64 == 0:
            progress(j, len(todo))
        # model_copy skips validation: each field set here is one the schema accepts (the best
        # candidates are validated through their overrides below)
        r = recipe.model_copy(update={
            "layout": recipe.layout.model_copy(update=cand.layout),
            "batch": recipe.batch.model_copy(update={"mbs": cand.mbs}),
            "recompute": recipe.recompute.model_copy(update={"granularity": cand.granularity, "modules": cand.modules})})
        plan, report = make_plan(resolved.with_layout(r, gpus=world), strict=False)
        if report.errors or plan.time is None or plan.used is None or not (plan.fits and plan.fits_used):
            continue
        t = plan.time
        found.append(Candidate(label=cand.label(plan.stages), overrides=cand.overrides(), tokens_per_s_per_gpu=t.tokens_per_s_per_gpu, step_s=t.step_s,
                               used_gib=plan.used.used_gib, allocated_gib=plan.used.allocated_gib,
                               dominant=t.dominant, dominant_s=t.terms_s[t.dominant]))
    if progress:
        progress(len(todo), len(todo))
    found.sort(key=lambda c: -c.tokens_per_s_per_gpu)
    best = found[:top]
    for c in best:  # the overrides must give back the same layout through the schema
        apply(recipe, c.overrides)
    return best, len(todo)
