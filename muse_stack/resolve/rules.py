"""The layout rules megatron-core enforces, checked before a run costs a GPU-hour.

Each rule returns :class:`LayoutError` values naming the field, the value, the rule and a fix.
A rule whose inputs the recipe leaves unstated is reported as unchecked, not guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from muse_stack.util.errors import LayoutError
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes.layout import data_parallel, micro_batches, pack_alignment, stage_layers
from muse_stack.recipes.schema import Recipe


@dataclass
class RuleReport:
    errors: list[LayoutError] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_errors(self) -> None:
        """Raise the first error, the others in its message."""
        if not self.errors:
            return
        first = self.errors[0]
        if len(self.errors) > 1:
            rest = "\n".join(f"  also: {e.render()}" for e in self.errors[1:])
            raise LayoutError(f"{first.message}\n{rest}", field=first.field, value=first.value, rule=first.rule,
                              fix=first.fix)
        raise first


def _divisors_hint(n: int, limit: int = 8) -> str:
    """The smallest ``limit`` divisors of ``n``; pairs up to sqrt(n), so it stays fast for any bounded size."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    divs = small + large[::-1]
    return ", ".join(str(d) for d in divs[:limit]) + (" ..." if len(divs) > limit else "")


def check(recipe: Recipe, model: ModelConfig, world: int) -> RuleReport:
    rep = RuleReport()
    lay, batch = recipe.layout, recipe.batch
    err = rep.errors.append
    tp, pp, etp = lay.tp, lay.pp, lay.etp
    cp, ep = lay.cp, lay.ep

    # -- world = TP x PP x CP x DP -----------------------------------------------------
    if cp is None:
        rep.unchecked.append("TP x PP x CP x DP = GPUs: layout.cp is not stated (pass layout.cp=N)")
    else:
        denom = tp * pp * cp
        if world % denom:
            err(LayoutError("the GPUs do not divide into TP x PP x CP groups", field="hardware.count", value=world,
                            rule=f"TP x PP x CP x DP = GPUs, and TP x PP x CP = {tp} x {pp} x {cp} = {denom}",
                            fix=f"use a multiple of {denom} GPUs or change layout.tp/pp/cp"))
        elif lay.dp is not None and lay.dp != world // denom:
            err(LayoutError("the stated data-parallel size does not match the GPUs", field="layout.dp", value=lay.dp,
                            rule=f"DP = GPUs / (TP x PP x CP) = {world} / {denom} = {world // denom}",
                            fix=f"set layout.dp={world // denom} or change hardware.count to {lay.dp * denom}"))

    # -- experts ------------------------------------------------------------------------
    if ep is None:
        rep.unchecked.append("experts divisible by EP and GPUs by ETP x EP x PP: layout.ep is not stated (pass layout.ep=N)")
    else:
        if world % (etp * ep * pp):
            err(LayoutError("the GPUs do not divide into expert groups", field="layout.ep", value=ep,
                            rule=f"GPUs divisible by ETP x EP x PP = {etp} x {ep} x {pp} = {etp * ep * pp}",
                            fix=f"choose EP so that {etp * pp} x EP divides {world}: EP in "
                                f"{{{_divisors_hint(world // math.gcd(world, etp * pp))}}}"))
        if model.num_local_experts % ep:
            err(LayoutError("the experts do not split evenly over the EP ranks", field="layout.ep", value=ep,
                            rule=f"experts ({model.num_local_experts}) divisible by EP",
                            fix=f"choose EP from {{{_divisors_hint(model.num_local_experts, 10)}}}"))

    # -- pipeline split -------------------------------------------------------------------
    stages = stage_layers(lay, model.num_hidden_layers)
    if lay.pp_layers is not None and len(lay.pp_layers) != pp:
        err(LayoutError("one layer count is needed per pipeline stage", field="layout.pp_layers", value=lay.pp_layers,
                        rule=f"len(pp_layers) = PP = {pp}", fix=f"list {pp} layer counts or set layout.pp={len(lay.pp_layers)}"))
    elif stages is None:
        if lay.first_stage_layers is None and lay.last_stage_layers is None:
            fix = (f"{model.num_hidden_layers} layers split evenly only at PP in "
                   f"{{{_divisors_hint(model.num_hidden_layers)}}}; give layout.first_stage_layers and "
                   f"layout.last_stage_layers (or layout.pp_layers) for uneven stages")
            err(LayoutError("the layers do not split evenly over the pipeline stages", field="layout.pp", value=pp,
                            rule=f"{model.num_hidden_layers} layers divisible by PP", fix=fix))
        else:
            err(LayoutError("the middle stages cannot hold the remaining layers evenly",
                            field="layout.first_stage_layers", value=[lay.first_stage_layers, lay.last_stage_layers],
                            rule=f"({model.num_hidden_layers} - first - last) divisible by PP - 2 = {pp - 2}",
                            fix="pick first/last stage counts that leave a multiple of PP - 2 layers"))
    elif sum(stages) != model.num_hidden_layers:
        err(LayoutError("the stage layer counts do not add up to the model's layers", field="layout.pp_layers",
                        value=stages, rule=f"sum of stage layers = {model.num_hidden_layers}",
                        fix=f"make the counts sum to {model.num_hidden_layers} (now {sum(stages)})"))
    elif any(n < 1 for n in stages) and pp > 1:
        err(LayoutError("a pipeline stage holds no layers", field="layout.pp_layers", value=stages,
                        rule="every stage holds at least one layer", fix="lower layout.pp or move layers"))

    # -- tensor parallel --------------------------------------------------------------------
    for name, heads in (("attention heads", model.num_attention_heads), ("KV heads", model.num_key_value_heads)):
        if heads % tp:
            err(LayoutError(f"the {name} do not split over the TP ranks", field="layout.tp", value=tp,
                            rule=f"{name} ({heads}) divisible by TP",
                            fix=f"choose TP from {{{_divisors_hint(math.gcd(model.num_attention_heads, model.num_key_value_heads))}}}"))
    if lay.sequence_parallel and tp == 1:
        err(LayoutError("sequence parallelism needs tensor parallelism", field="layout.sequence_parallel", value=True,
                        rule="sequence parallel needs TP > 1", fix="set layout.sequence_parallel=false or layout.tp>1"))
    if tp > 1 and lay.sequence_parallel is False:
        err(LayoutError("MoE layers with tensor parallelism need sequence parallelism",
                        field="layout.sequence_parallel", value=False,
                        rule="megatron-core: MoE with TP > 1 requires sequence parallelism",
                        fix="set layout.sequence_parallel=true"))
    if tp > 1 and lay.sequence_parallel is None:
        rep.assumptions.append("layout.sequence_parallel is not stated; megatron-core requires it for MoE with TP > 1, "
                               "so the plan assumes it on")

    # -- batch ------------------------------------------------------------------------------
    if batch.mbs is None or batch.gbs is None:
        rep.unchecked.append("GBS divisible by MBS x DP: batch.mbs or batch.gbs is not stated")
    else:
        try:
            micro_batches(batch.gbs, batch.mbs, data_parallel(world, lay), strict=True)
        except LayoutError as exc:
            err(exc)
    if batch.packed and batch.mbs is not None and batch.mbs != 1:
        err(LayoutError("offline packed sequences need micro-batch 1", field="batch.mbs", value=batch.mbs,
                        rule="offline packing needs MBS 1", fix="set batch.mbs=1 (pack more into each sequence instead)"))

    # -- context parallel -------------------------------------------------------------------
    if cp is not None and cp > 1:
        has_sliding = any(t == "sliding_attention" for t in model.resolved_layer_types)
        if has_sliding and lay.cp_comm_type != "a2a":
            err(LayoutError("context parallelism over sliding-window layers needs the A2A comm type",
                            field="layout.cp_comm_type", value=lay.cp_comm_type,
                            rule="Transformer Engine rejects P2P (and others) for sliding-window attention under CP",
                            fix="set layout.cp_comm_type=a2a"))
        if lay.cp_comm_type == "a2a" and model.num_key_value_heads % tp == 0:
            kv_local = model.num_key_value_heads // tp
            if kv_local % cp:
                err(LayoutError("the a2a exchange splits each rank's attention heads over CP, and the KV heads "
                                "do not split", field="layout.cp", value=cp,
                                rule=f"KV heads per TP rank ({model.num_key_value_heads} / {tp} = {kv_local}) "
                                     f"divisible by CP (Transformer Engine, cp_comm_type a2a)",
                                fix=f"use a CP that divides {kv_local}, or a smaller TP"))
        align = pack_alignment(lay)
        if batch.pack_alignment is not None and batch.pack_alignment % align:
            err(LayoutError("packed sequences are aligned to a multiple CP cannot split", field="batch.pack_alignment",
                            value=batch.pack_alignment,
                            rule=f"alignment a multiple of lcm(2 x CP, TP x CP with sequence parallel) = {align}",
                            fix=f"set batch.pack_alignment={align}"))
    # -- sequence length: checked whatever CP is (CP 1 with TP > 1 and SP still splits the sequence) --
    if cp is None:
        rep.unchecked.append("sequence divisible by the CP and TP split: layout.cp is not stated (pass layout.cp=N)")
    elif batch.seq_length is not None:
        sp = lay.sequence_parallel if lay.sequence_parallel is not None else tp > 1  # as the plan assumes
        divisor = math.lcm(2 * cp if cp > 1 else 1, tp * cp if sp else 1)
        if batch.seq_length % divisor:
            err(LayoutError("the sequence length does not divide into the tensor/context-parallel chunks",
                            field="batch.seq_length", value=batch.seq_length,
                            rule=f"sequence divisible by lcm(2 x CP, TP x CP with sequence parallel) = {divisor} "
                                 f"(2 x CP counts when CP > 1; here TP {tp}, CP {cp}, sequence parallel {sp})",
                            fix=f"use a multiple of {divisor}, e.g. {max(1, batch.seq_length // divisor) * divisor}"))
    return rep
