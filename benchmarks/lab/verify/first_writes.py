"""The step's first micro-batch writing the main gradients (``engine_options.first_micro_batch_writes``)
against megatron-core zeroing the whole grad buffer, on a GPU.

``python -m lab.verify.first_writes [--steps K] [--out FILE]``. Two engines of the small
parity model (:mod:`.parity`) start from the same weights, in ``numerics.deterministic`` mode, and
train K steps of two micro-batches each on the same row. One zeroes every grad buffer (megatron-core's
``zero_grad_buffer``); the other lets TE's GEMMs write the decoder weights' gradients in the first
micro-batch. Before each of the second engine's steps its grad buffers are filled with NaN, so a range
that is neither zeroed nor written shows. At the optimizer step both engines' grad buffers are
copied and compared element by element.

The row is 32 tokens and each token picks 1 of 64 experts, so at least 32 experts get no token in
the first micro-batch: their GEMMs have no rows, and their gradients must still come out zero.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from lab.verify.parity import TINY, _OneBatch, seeded_start, steps_main, tiny_recipe
from muse_stack.engines.base import TrainContext
from muse_stack.resolve.recipe import finalize
from muse_stack.recipes.catalogue import parse_recipe

#: 32 tokens, top-1 of 64 experts: at least half the experts get no token
SEQ, EXPERTS, TOPK = 32, 64, 1


def _recipe(first_writes: bool | None):
    doc = tiny_recipe().model_dump(mode="json")
    doc["model"]["overrides"] = dict(TINY, num_local_experts=EXPERTS, num_experts_per_tok=TOPK)
    doc["batch"].update(mbs=1, gbs=2, seq_length=SEQ)
    doc["layout"]["dispatcher"] = "allgather"  # as slice-1gpu: the counts reach the host before the experts run
    doc["numerics"] = {"deterministic": True}
    doc["engine_options"] = dict(doc.get("engine_options") or {}, first_micro_batch_writes=first_writes)
    return parse_recipe(doc, "first-writes-tiny")


def _engine(first_writes: bool | None, state: dict[str, torch.Tensor], batch: dict[str, Any], steps: int):
    """The engine and the run's steps around it (LR, micro-batches of the one row)."""
    from lab.engine import LoadedEngine
    from muse_stack.run.steps import TrainSteps

    recipe = _recipe(first_writes)
    resolved = finalize(recipe, gpus=1)
    ctx = TrainContext(recipe=recipe, model=resolved.model, resolved=resolved, rank=0, world_size=1, local_rank=0)
    engine = LoadedEngine(ctx, state)
    return engine, TrainSteps(engine, recipe, _OneBatch(batch), steps)


def _buffers(engine) -> list[torch.Tensor]:
    return [b.grad_data for b in list(engine.model.buffers) + list(engine.model.expert_parallel_buffers)]


def _capture(engine, into: list) -> None:
    """Copy the grad buffers as the optimizer step begins (after the last micro-batch's backward)."""
    step = engine.optimizer.step

    def capturing_step(*args, **kwargs):
        into.append([g.clone() for g in _buffers(engine)])
        return step(*args, **kwargs)

    engine.optimizer.step = capturing_step


def run(steps: int = 2, seed: int = 1234) -> dict[str, Any]:
    state, batch = seeded_start(_recipe(None), SEQ, seed)

    whole, whole_steps = _engine(False, state, batch, steps)
    assert whole.first_writes is None
    whole_grads: list = []
    _capture(whole, whole_grads)
    whole_stats = [whole_steps.step(s) for s in range(1, steps + 1)]
    whole_levers = whole.describe()["levers"]["grad_buffer_zeroing"]
    del whole, whole_steps
    torch.cuda.empty_cache()

    writes, writes_steps = _engine(None, state, batch, steps)
    assert writes.first_writes is not None, writes.options_off["first_micro_batch_writes"]
    written_grads: list = []
    _capture(writes, written_grads)
    first_counts: list[list[int]] = []  # each MoE layer's expert token counts in a step's first micro-batch

    def note_counts(module, args):
        if writes.first_writes.armed:
            first_counts.append([int(n) for n in args[1].tolist()])

    from muse_stack.engines.mcore.layers import MuseSparkExperts

    hooks = [m.register_forward_pre_hook(note_counts) for m in writes.model.module.modules()
             if isinstance(m, MuseSparkExperts)]
    written_stats = []
    for s in range(1, steps + 1):
        for g in _buffers(writes):
            g.fill_(math.nan)  # what neither the zeroing nor the first micro-batch touches stays NaN
        written_stats.append(writes_steps.step(s))
    for h in hooks:
        h.remove()
    empty = [sum(1 for n in counts if n == 0) for counts in first_counts]  # experts with no token
    compared = []
    for step, (a, b) in enumerate(zip(whole_grads, written_grads), start=1):
        for i, (x, y) in enumerate(zip(a, b)):
            diff = (x - y).abs()
            compared.append({"step": step, "buffer": i, "elements": x.numel(),
                             "non_finite_written": int((~torch.isfinite(y)).sum()),
                             "unequal": int((x != y).sum()), "max_abs_diff": float(diff.max()) if x.numel() else 0.0})
    return {"steps": steps, "model": dict(TINY, num_local_experts=EXPERTS, num_experts_per_tok=TOPK), "seq_length": SEQ,
            "micro_batches": 2, "deterministic": True,
            "whole_buffer": whole_levers, "first_writes": writes.describe()["levers"]["grad_buffer_zeroing"],
            "empty_experts_first_micro_batch": empty,
            "losses_whole": [s.loss for s in whole_stats], "losses_first_writes": [s.loss for s in written_stats],
            "grad_norms_whole": [s.grad_norm for s in whole_stats],
            "grad_norms_first_writes": [s.grad_norm for s in written_stats],
            "buffers": compared}


def main(argv: list[str] | None = None) -> int:
    return steps_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
