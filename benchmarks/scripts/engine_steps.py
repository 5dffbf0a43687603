"""Throughput of the megatron engine's training step, with or without adapters, in one process.

This drives the engine's own ``train_step`` exactly as the runner does, with no checkpoints,
logging or fingerprint around it, and times each step with a CUDA synchronisation: the same
measurement for full training and for adapters on a frozen base. Python's collector runs as the
recipe's ``training.gc`` says, as in the runner (by hand, between steps; the result's ``gc``).

Model FLOPs per token: the runner's formula (:mod:`muse_stack.models.muse_spark.flops`), with the adapter form
for a frozen base (forward and backward to inputs of the base, the adapters' full training).

    PYTHONPATH=. python benchmarks/scripts/engine_steps.py slice-1gpu [overrides...] --steps 30 --warmup 10 --out x.json
    (each attribution flag runs the engine with one of its options set otherwise: as the engine ran before, or a
     candidate. The flags are the engine option table's (muse_stack/recipes/options.py, each row's attribution):
     a flag is the override it names, engine_options.KEY=VALUE, applied with the others; --help lists them.)
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import finish, megatron_engine, recipe_args  # noqa: E402
from muse_stack.recipes.options import attribution_flags  # noqa: E402


def attributed(args) -> dict[str, str]:
    """Each attribution flag given, with the override it sets; two flags that set one option both ways are refused."""
    chosen: dict[str, str] = {}
    by_option: dict[str, str] = {}
    for flag, (option, attribution) in attribution_flags().items():
        if not getattr(args, flag[2:].replace("-", "_")):
            continue
        override = option.override(attribution.value)
        other = by_option.setdefault(option.key, flag)
        if other != flag and chosen[other] != override:
            raise SystemExit(f"{other} and {flag} set {option.field} both ways: give one")
        chosen[flag] = override
    return chosen


def parser():
    """The recipe's arguments and one flag per attribution of the engine option table."""
    ap = recipe_args(steps=30, warmup=10)
    for flag, (option, attribution) in attribution_flags().items():
        ap.add_argument(flag, action="store_true", help=f"{attribution.what} ({option.override(attribution.value)})")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    flags = attributed(args)

    from muse_stack.models.muse_spark.flops import FORMULA, PEFT_FORMULA, training_flops_per_token
    from muse_stack.machine.devmem import cuda_memory
    from muse_stack.models.muse_spark.peft_config import resolve
    from muse_stack.machine.peak import peak_for

    recipe, engine, steps = megatron_engine(args.recipe, [*args.overrides, *flags.values()], args.steps)
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
        "recipe": args.recipe, "overrides": args.overrides, "attribution": flags,
        "device": torch.cuda.get_device_name(),
        "experts_swiglu": "weighted, given ones" if args.weighted_swiglu else "unweighted",
        "optimizer": describe["optimizer"],
        # the recipe's engine options as megatron-core, TE and the engine's modules hold them (h200.sh levers5)
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
