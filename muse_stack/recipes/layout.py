"""Derived layout facts of a recipe's ``layout``: world size, data-parallel sizes, the pipeline split,
packing alignment."""

from __future__ import annotations

import math

from muse_stack.recipes.schema import Layout
from muse_stack.util.errors import LayoutError


def pack_alignment(layout: Layout) -> int:
    """The multiple each packed sequence is padded to, as Megatron-Bridge pads for context
    parallelism: lcm(2 x CP, TP x CP) with sequence parallelism and CP > 1, 2 x CP with CP > 1,
    else 1. (A recipe's ``batch.pack_alignment`` must be a multiple of it.)"""
    cp = layout.cp or 1
    if cp > 1 and layout.sequence_parallel:
        return math.lcm(2 * cp, layout.tp * cp)
    if cp > 1:
        return 2 * cp
    return 1


def stage_layers(layout: Layout, num_layers: int) -> list[int] | None:
    """Decoder layers per pipeline stage, or None when the stated split does not resolve."""
    pp = layout.pp
    if layout.pp_layers is not None:
        return list(layout.pp_layers)
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is None and last is None:
        return [num_layers // pp] * pp if num_layers % pp == 0 else None
    if pp == 1:
        return [num_layers]
    first = first if first is not None else None
    last = last if last is not None else None
    middle_stages = pp - 2
    if first is None or last is None:
        known = first if first is not None else last
        rest = num_layers - known
        if rest % (pp - 1):
            return None
        each = rest // (pp - 1)
        return [known] + [each] * (pp - 1) if first is not None else [each] * (pp - 1) + [known]
    rest = num_layers - first - last
    if middle_stages == 0:
        return [first, last] if rest == 0 else None
    if rest < 0 or rest % middle_stages:
        return None
    return [first] + [rest // middle_stages] * middle_stages + [last]


def data_parallel(world: int, layout: Layout) -> int | None:
    cp = layout.cp
    if cp is None:
        return None
    denom = layout.tp * layout.pp * cp
    return world // denom if world % denom == 0 else None


def micro_batches(gbs: int | None, mbs: int | None, dp: int | None, *, strict: bool = False) -> int | None:
    """Micro-batches per data-parallel replica per step: GBS / (MBS x DP). None where a size is
    unknown or the global batch does not split into whole micro-batches per replica (``strict``:
    that is a :class:`LayoutError` naming ``batch.gbs``)."""
    if not (gbs and mbs and dp):
        return None
    per_step = mbs * dp
    if gbs % per_step:
        if strict:
            raise LayoutError("the global batch does not split into whole micro-batches per replica",
                              field="batch.gbs", value=gbs,
                              rule=f"GBS divisible by MBS x DP = {mbs} x {dp} = {per_step}",
                              fix=f"use a multiple of {per_step}, e.g. {max(1, round(gbs / per_step)) * per_step}")
        return None
    return gbs // per_step


def expert_data_parallel(world: int, layout: Layout) -> int | None:
    """The group expert parameters (and their optimizer state) are replicated over:
    world / (EP x ETP x PP)."""
    if layout.ep is None:
        return None
    denom = layout.ep * layout.etp * layout.pp
    return world // denom if world % denom == 0 else None
