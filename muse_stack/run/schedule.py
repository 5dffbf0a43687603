"""The learning-rate schedule a recipe states: linear warmup, then cosine/linear/constant decay."""

from __future__ import annotations

import math

from muse_stack.recipes.schema import Optimizer


def warmup_steps(opt: Optimizer, total_steps: int) -> int:
    if opt.warmup_steps is not None:
        return opt.warmup_steps
    if opt.warmup_fraction is not None:
        return int(opt.warmup_fraction * total_steps)
    return 0


def lr_at(step: int, opt: Optimizer, total_steps: int) -> float:
    """LR for 1-based ``step``: warmup reaches the peak at the last warmup step, then decays to
    ``min_lr`` at ``total_steps``."""
    if opt.lr is None:
        raise ValueError("optimizer.lr is not stated")  # run and launch refuse such a recipe first
    peak = opt.lr
    floor = opt.min_lr if opt.min_lr is not None else peak  # only a decaying schedule reads it, and states it
    warm = warmup_steps(opt, total_steps)
    if warm and step <= warm:
        return peak * step / warm
    style = opt.decay_style or "constant"
    if style == "constant" or total_steps <= warm:
        return peak
    progress = min(1.0, (step - warm) / max(1, total_steps - warm))
    if style == "linear":
        return peak - (peak - floor) * progress
    if style == "cosine":
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: stable then a linear decay over the last 10%
    decay_start = 0.9
    return peak if progress < decay_start else peak - (peak - floor) * (progress - decay_start) / (1 - decay_start)
