"""Engine overhead: the engine's train_step against a minimal megatron-core loop, same GPU,
same process, same model, optimizer and data.

The minimal loop is what any megatron-core training script does per step: zero the grad
buffers, ``get_forward_backward_func()`` over the micro-batches (already on the GPU), the
optimizer step, one ``torch.cuda.synchronize()``. The engine's step adds the LR schedule, the
data iterator and host-to-device copies, and the loss/token reduction. Steps alternate
(engine, minimal, engine, ...) after warm-up so clock or thermal drift hits both alike.

    PYTHONPATH=. python benchmarks/scripts/overhead.py slice-1gpu --steps 10 --warmup 3 --out overhead.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import finish, megatron_engine, recipe_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = recipe_args(steps=10, warmup=3).parse_args(argv)

    from megatron.core.pipeline_parallel import get_forward_backward_func

    total = 2 * (args.steps + args.warmup)
    recipe, engine, steps = megatron_engine(args.recipe, args.overrides, total)
    fixed = [engine._prepare(mb) for mb in steps.data.next_step()]

    def minimal_step() -> float:
        t0 = time.perf_counter()
        engine.model.zero_grad_buffer()
        engine.optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=engine._forward_step, data_iterator=iter(fixed),
                                    model=[engine.model], num_microbatches=len(fixed),
                                    seq_length=engine.seq_length, micro_batch_size=recipe.batch.mbs,
                                    forward_only=False)
        engine.optimizer.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def engine_step(step: int) -> float:
        t0 = time.perf_counter()
        steps.step(step)
        return time.perf_counter() - t0

    eng, mini = [], []
    step = 0
    for i in range(args.warmup + args.steps):
        step += 1
        e = engine_step(step)
        m = minimal_step()
        if i >= args.warmup:
            eng.append(e)
            mini.append(m)
    result = {
        "recipe": recipe.name, "overrides": args.overrides, "steps_timed": args.steps, "warmup_pairs": args.warmup,
        "engine_step_s": eng, "minimal_step_s": mini,
        "engine_mean_s": statistics.fmean(eng), "minimal_mean_s": statistics.fmean(mini),
        "engine_median_s": statistics.median(eng), "minimal_median_s": statistics.median(mini),
        "overhead_percent_mean": (statistics.fmean(eng) / statistics.fmean(mini) - 1) * 100,
        "overhead_percent_median": (statistics.median(eng) / statistics.median(mini) - 1) * 100,
        "target_percent": 3.0, "device": torch.cuda.get_device_name(),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    finish(result, args.out, omit=lambda k: k.endswith("step_s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
