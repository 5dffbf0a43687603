"""Throughput of the megatron engine's training step, with or without adapters, in one process.

This drives the engine's own ``train_step`` exactly as the runner does, with no checkpoints,
logging or fingerprint around it, and times each step with a CUDA synchronisation: the same
measurement for full training and for adapters on a frozen base. Python's collector runs as the
recipe's ``training.gc`` says, as in the runner (by hand, between steps; the result's ``gc``).

Model FLOPs per token: the runner's formula (:mod:`muse_stack.models.muse_spark.flops`), with the adapter form
for a frozen base (forward and backward to inputs of the base, the adapters' full training).

    PYTHONPATH=. python benchmarks/scripts/engine_steps.py slice-1gpu [overrides...] --steps 30 --warmup 10 --out x.json
    (each flag of SWITCHES below runs one change as the engine ran it before, or a candidate; --help lists them.
     The grad buffer zeroed whole every step is the override performance.first_micro_batch_writes=false)
"""

from __future__ import annotations

import gc
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import finish, megatron_engine, recipe_args  # noqa: E402


#: the attribution switches: (flag, what it runs, module, object.attribute, the value the flag sets there)
SWITCHES = (
    ("--weighted-swiglu", "the experts' SwiGLU as the engine ran it before: megatron-core's weighted one, given ones",
     "muse_stack.engines.mcore.layers", "MuseSparkExperts.unweighted_swiglu", False),
    ("--te-clip-scale", "the clip's scale as megatron-core runs it: TE's multi_tensor_scale_tensor every step",
     "muse_stack.engines.mcore.clip_scale", "skip_unclipped", False),
    ("--late-counts", "the experts' token counts as megatron-core's allgather dispatcher reads them: .cpu() after the "
                      "latent GEMM, then masked_select",
     "muse_stack.engines.mcore.dispatch", "EarlyCountAllGatherDispatcher.early_counts", False),
    ("--separate-pre-mlp-norm", "the pre-MLP norm as its own chain after the post-attention residual's",
     "muse_stack.engines.mcore.layers", "MuseSparkLayer.fused_pre_mlp_norm", False),
    ("--mcore-swiglu", "the experts' SwiGLU backward as megatron-core's compiled one instead of TE's dswiglu",
     "muse_stack.engines.mcore.layers", "MuseSparkExperts.te_swiglu_backward", False),
    ("--te-adam", "the Adam step as TE's FusedAdam runs it: multi_tensor_adam launches instead of one Triton "
                  "launch per parameter group (muse_stack/engines/mcore/adam_step.py)",
     "muse_stack.engines.mcore.adam_step", "enabled", False),
    ("--dense-embedding-grad", "the word embedding's backward as megatron-core's: a dense bf16 gradient of the table, "
                               "added into main_grad by DDP (muse_stack/engines/mcore/embedding_grad.py)",
     "muse_stack.engines.mcore.embedding_grad", "enabled", False),
    ("--compiled-norm-backward", "the post-expert norm's backward as the compiled chain's (TorchInductor) instead of "
                                 "one Triton pass (muse_stack/engines/mcore/norm_backward.py)",
     "muse_stack.engines.mcore.layers", "MuseSparkExperts.fused_norm_backward", False),
    ("--fused-norm-backward", "the post-expert norm's backward as one Triton pass, as shipped since "
                              "benchmarks/results/embedgrad/ (the runs in normbwd/, adam/ and embedgrad/ name it)",
     "muse_stack.engines.mcore.layers", "MuseSparkExperts.fused_norm_backward", True),
    ("--inductor-multi-kernel", "a candidate, not shipped: the compiled elementwise chains with TorchInductor's "
                                "multi-kernel (persistent row reductions up to 16,384 columns, benchmarked against "
                                "looped ones)",
     "torch._inductor.config", "triton.multi_kernel", 1),
)


def _switch(module: str, path: str, value) -> None:
    """Set ``module.path`` (an attribute of an object in the module) to ``value`` for this process."""
    owner = importlib.import_module(module)
    *objects, attribute = path.split(".")
    for name in objects:
        owner = getattr(owner, name)
    setattr(owner, attribute, value)


def main(argv: list[str] | None = None) -> int:
    ap = recipe_args(steps=30, warmup=10)
    for flag, what, *_ in SWITCHES:
        ap.add_argument(flag, action="store_true", help=what)
    args = ap.parse_args(argv)
    for flag, _, module, path, value in SWITCHES:
        if getattr(args, flag[2:].replace("-", "_")):
            _switch(module, path, value)

    from muse_stack.models.muse_spark.flops import FORMULA, PEFT_FORMULA, training_flops_per_token
    from muse_stack.machine.devmem import cuda_memory
    from muse_stack.recipes.peft import resolve
    from muse_stack.machine.peak import peak_for

    recipe, engine, steps = megatron_engine(args.recipe, args.overrides, args.steps)
    cfg = recipe.model_config_resolved()
    collector = recipe.training.gc
    if collector.manual:  # as the runner does (run/trainer.py): no automatic collection inside a step
        gc.collect()
        gc.freeze()
        gc.disable()
    rows = []
    for step in range(1, args.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = steps.step(step)
        torch.cuda.synchronize()
        rows.append({"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm, "tokens": stats.tokens,
                     "step_time_s": time.perf_counter() - t0})
        if collector.due(step):
            gc.collect()  # between steps, outside the timed region, as the runner
    window = rows[args.warmup:]
    tps = sum(r["tokens"] for r in window) / sum(r["step_time_s"] for r in window)
    settings = resolve(recipe.peft, cfg) if recipe.peft is not None else None
    flops = training_flops_per_token(cfg, engine.seq_lens(), peft=settings)
    per_token = flops["training"]
    adapter_active = flops.get("adapter_params_per_token", 0.0)
    formula = PEFT_FORMULA if settings is not None else FORMULA
    peak, source = peak_for(recipe.hardware.gpu)
    describe = engine.describe()
    result = {
        "recipe": args.recipe, "overrides": args.overrides, "device": torch.cuda.get_device_name(),
        "experts_swiglu": "weighted, given ones" if args.weighted_swiglu else "unweighted",
        "optimizer": describe["optimizer"],
        # the recipe's fusions / performance settings as megatron-core and TE hold them (h200.sh levers5)
        "levers": describe["levers"],
        "method": f"{args.steps} steps, window steps {args.warmup + 1}-{args.steps}; each step bracketed by "
                  "torch.cuda.synchronize()",
        "gc": (f"by hand as the runner (training.gc): frozen and off after setup, collected after every "
               f"{collector.interval or 'no'} step(s), outside the timed region") if collector.manual
        else "Python's automatic collector (training.gc.manual: false)",
        "tokens_per_s_per_gpu": tps, "step_time_mean_s": statistics.fmean(r["step_time_s"] for r in window),
        "flops_per_token": per_token, "flops_formula": formula, "adapter_active_params_per_token": adapter_active,
        "model_tflops_per_gpu": per_token * tps / 1e12, "peak_tflops": peak, "peak_source": source,
        "mfu": per_token * tps / 1e12 / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device_memory": cuda_memory(f"cuda:{torch.cuda.current_device()}"),
        "local_parameters": describe["local_parameters"],
        "local_trainable_parameters": describe["local_trainable_parameters"], "adapters": describe["adapters"],
        "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"], "steps": rows,
    }
    finish(result, args.out, omit=lambda k: k == "steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
