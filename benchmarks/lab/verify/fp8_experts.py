"""The experts under FP8 on the allgather dispatcher: the engine's own path (each expert's rows padded to the FP8
GEMM multiple around the fused unweighted SwiGLU) against megatron-core's expert forward (its padding, its weighted
SwiGLU given ones), on a GPU.

``python -m lab.verify.fp8_experts [--steps K] [--out FILE]``. Two engines of the small parity model (:mod:`.parity`)
start from the same weights in ``numerics.deterministic`` mode, ``precision: fp8`` (tensorwise current scaling,
hybrid format) with the allgather dispatcher, and train K steps of two micro-batches each on the same row; they
differ only in ``engine_options.unweighted_swiglu``. The row is 32 tokens and each picks 1 of 64 experts, so every
expert's row count is below the FP8 multiple of 16 and most are zero: all of them are padded.

The forward computes the same numbers both ways: the same pad rows (zeros) in the same places, the same FP8 GEMMs
on them, and a SwiGLU that computes in fp32 and rounds once to bf16, times a weight of exactly 1 in megatron-core's.
So the first step's loss is equal bit for bit. The backward differs where the two SwiGLU backward kernels round
differently (each within one bf16 rounding of the exact value), and the FP8 quantization of the GEMMs' gradient
inputs can turn such a last-bit difference into one FP8 step: the gradients are close, not equal, and are reported.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from lab.verify.parity import TINY, _OneBatch, seeded_start, steps_main, tiny_recipe
from muse_stack.engines.base import TrainContext
from muse_stack.resolve.recipe import finalize
from muse_stack.recipes.catalogue import parse_recipe

#: 32 tokens, top-1 of 64 experts: every expert's rows below the FP8 multiple
SEQ, EXPERTS, TOPK = 32, 64, 1


def _recipe(unweighted: bool):
    doc = tiny_recipe().model_dump(mode="json")
    doc["model"]["overrides"] = dict(TINY, num_local_experts=EXPERTS, num_experts_per_tok=TOPK)
    doc["batch"].update(mbs=1, gbs=2, seq_length=SEQ)
    doc["layout"]["dispatcher"] = "allgather"  # as slice-1gpu ships
    doc["precision"] = "fp8"
    doc["fp8"] = {"recipe": "tensorwise", "format": "hybrid"}
    doc["numerics"] = {"deterministic": True}
    doc["engine_options"] = dict(doc.get("engine_options") or {}, unweighted_swiglu=unweighted)
    return parse_recipe(doc, "fp8-experts-tiny")


def _train(unweighted: bool, state: dict[str, torch.Tensor], batch: dict[str, Any], steps: int) -> dict[str, Any]:
    from lab.engine import LoadedEngine
    from muse_stack.engines.mcore.layers import MuseSparkExperts
    from muse_stack.run.steps import TrainSteps

    recipe = _recipe(unweighted)
    resolved = finalize(recipe, gpus=1)
    ctx = TrainContext(recipe=recipe, model=resolved.model, resolved=resolved, rank=0, world_size=1, local_rank=0)
    engine = LoadedEngine(ctx, state)
    experts = [m for m in engine.model.module.modules() if isinstance(m, MuseSparkExperts)]
    plain = [m._plain_swiglu() for m in experts]
    counts: list[list[int]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: counts.append([int(n) for n in args[1].tolist()]))
             for m in experts]
    driven = TrainSteps(engine, recipe, _OneBatch(batch), steps)
    stats = [driven.step(s) for s in range(1, steps + 1)]
    for h in hooks:
        h.remove()
    out = {"unweighted_swiglu": unweighted, "engine_path": sorted(set(plain)),
           "losses": [s.loss for s in stats], "grad_norms": [s.grad_norm for s in stats],
           "largest_expert_rows": max(max(c) for c in counts)}
    del driven, engine
    torch.cuda.empty_cache()
    return out


def run(steps: int = 2, seed: int = 1234) -> dict[str, Any]:
    state, batch = seeded_start(_recipe(True), SEQ, seed)
    megatron = _train(False, state, batch, steps)
    ours = _train(True, state, batch, steps)
    return {"steps": steps, "model": dict(TINY, num_local_experts=EXPERTS, num_experts_per_tok=TOPK),
            "seq_length": SEQ, "micro_batches": 2, "deterministic": True, "fp8": {"recipe": "tensorwise",
                                                                                  "format": "hybrid"},
            "megatron_core_forward": megatron, "engine_forward": ours,
            "grad_norm_rel_diff": [abs(a - b) / b for a, b in zip(ours["grad_norms"], megatron["grad_norms"])]}


def main(argv: list[str] | None = None) -> int:
    return steps_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
