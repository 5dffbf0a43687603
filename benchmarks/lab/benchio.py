"""What the GPU benchmark and parity scripts share (``benchmarks/scripts/``, ``lab/verify/``):
their command line, the engine they build from a recipe, the GPU time of a call, and their end
(print the summary, write the JSON, close the process group)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def recipe_args(*, steps: int, warmup: int) -> argparse.ArgumentParser:
    """``RECIPE [OVERRIDES...] --steps N --warmup N --out FILE``, with a script's own defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--out", default=None)
    return ap


def megatron_engine(name: str, overrides: list[str], steps: int):
    """The recipe ``name`` with ``overrides`` and ``training.steps=steps``, the megatron engine built
    on it and the run's steps around the engine (the LR, the data and its micro-batches:
    :class:`muse_stack.run.steps.TrainSteps`), as ``muse-stack run`` would build them; returns all
    three. ``steps.step(n)`` runs step ``n`` as the runner does."""
    from muse_stack.data import build_for_recipe
    from muse_stack.engines.base import TrainContext
    from muse_stack.engines.megatron import MegatronEngine
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.resolve.recipe import resolve
    from muse_stack.run.steps import TrainSteps

    recipe = load_recipe(name, [*overrides, f"training.steps={steps}"])
    resolved = resolve(recipe)  # what the runner refuses, refused here too
    data = build_for_recipe(recipe, progress=False)
    engine = MegatronEngine(TrainContext(recipe=recipe, model=resolved.model, resolved=resolved,
                                         world_size=resolved.world))
    return recipe, engine, TrainSteps(engine, recipe, data, steps)


def cuda_median_seconds(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    """The median GPU time of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones, each
    bracketed by CUDA events on the current stream and waited for."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def finish(result: dict[str, Any], out: str | None, *, omit: Callable[[str], bool] = lambda key: False,
           summary: dict[str, Any] | None = None) -> None:
    """Print ``summary`` (default: ``result`` less the keys ``omit`` names, long per-step lists)
    on one line, write ``result`` whole to ``out`` when given, and destroy the process group the
    engine opened."""
    if summary is None:
        summary = {k: v for k, v in result.items() if not omit(k)}
    print(json.dumps(summary, default=str), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
