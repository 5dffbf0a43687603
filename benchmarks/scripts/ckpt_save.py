"""Step-time cost of a dist-checkpoint save on the megatron engine: synchronous, then
asynchronous (``training.async_checkpoint``), in one process on one model.

The save goes through the runner's own checkpoint manager (:class:`CheckpointManager`: the
``.partial`` folder, the engine's save, the commit and the ``latest`` pointer), exactly as
``muse-stack run`` calls it; only the loop around it is this script's, so that one checkpoint
is on disk at a time (a ``slice-1gpu`` checkpoint, weights plus the distributed optimizer's
fp32 state, is about 56 GiB).

Phases, each step timed with a CUDA synchronisation:
  warmup steps (not reported) -> baseline steps -> synchronous save (the loop waits for the
  whole write) -> steps -> the checkpoint deleted -> asynchronous save (the loop waits for the
  staging to host memory) -> steps, polling at each step boundary as the runner does, until
  the background write completes (at most --max-async-steps) -> steps after it.

Reported: the loop's blocked seconds for each save, the seconds until the folder was complete,
the baseline step time, the steps during the background write and their mean excess over
the baseline, and the total cost of each mode in seconds of training time
(blocked + sum of excess step time).

    PYTHONPATH=. python benchmarks/scripts/ckpt_save.py slice-1gpu --dir /tmp/ckpt-bench --out ckpt.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--dir", required=True, help="a new directory for the checkpoints (removed at the end)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="timed steps in each steady phase")
    ap.add_argument("--max-async-steps", type=int, default=120)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from muse_stack.data import build_for_recipe
    from muse_stack.engines.base import TrainContext
    from muse_stack.resolve.recipe import finalize
    from muse_stack.engines.megatron import MegatronEngine
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.machine.devmem import cuda_memory
    from muse_stack.run.checkpoints import CheckpointManager
    from muse_stack.run.steps import TrainSteps

    run_dir = Path(args.dir)
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: give a new directory")
    total = 1000  # the LR schedule's length; the loop below stops long before
    sync_recipe = load_recipe(args.recipe, [*args.overrides, f"training.steps={total}",
                                            "training.async_checkpoint=false"])
    async_recipe = load_recipe(args.recipe, [*args.overrides, f"training.steps={total}",
                                             "training.async_checkpoint=true"])
    data = build_for_recipe(sync_recipe, progress=False)
    resolved = finalize(sync_recipe, gpus=1)
    ctx = TrainContext(recipe=sync_recipe, model=resolved.model, resolved=resolved)
    engine = MegatronEngine(ctx)
    steps = TrainSteps(engine, sync_recipe, data, total)
    # one dist-checkpoint, as the engine estimates it for the runner's own free-space check (weights, fp32
    # main copy and both Adam moments; the metadata adds well under 2%): refuse before writing when it cannot fit
    needed = engine.checkpoint_bytes()
    free = shutil.disk_usage(run_dir.parent).free
    if free < 1.02 * needed:
        raise SystemExit(f"{run_dir.parent} has {free / 2**30:.1f} GiB free; one checkpoint needs about "
                         f"{needed / 2**30:.1f} GiB: give --dir on a larger file system")
    manager = CheckpointManager(run_dir, engine, interval=None, keep=1, states=steps.states())
    step = 0

    def timed_step() -> float:
        nonlocal step
        step += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps.step(step)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def save() -> dict:
        torch.cuda.synchronize()
        manager.save(step, {"recipe.yaml": ctx.recipe.name + "\n"})
        return dict(manager.saves[-1])

    def folder_bytes() -> int:
        return sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())

    for _ in range(args.warmup):
        timed_step()
    baseline = [timed_step() for _ in range(args.steps)]
    base = statistics.median(baseline)

    # synchronous
    sync = save()
    sync_bytes = folder_bytes()
    after_sync = [timed_step() for _ in range(args.steps)]
    shutil.rmtree(run_dir / "checkpoints")
    manager.last_step = None

    # asynchronous: the engine reads the switch from its recipe at each save
    ctx.recipe = async_recipe
    async_entry = save()
    during = []
    while manager._pending is not None and len(during) < args.max_async_steps:
        during.append(timed_step())
        manager.poll()
    if manager._pending is not None:
        manager.wait()
    async_entry = dict(manager.saves[-1])
    async_bytes = folder_bytes()
    after_async = [timed_step() for _ in range(args.steps)]
    shutil.rmtree(run_dir)

    def excess(times: list[float]) -> float:
        return sum(max(0.0, t - base) for t in times)

    result = {
        "recipe": args.recipe, "overrides": args.overrides, "device": torch.cuda.get_device_name(),
        "method": f"{args.warmup} warmup steps, then {args.steps} timed steps per steady phase; each step "
                  "bracketed by torch.cuda.synchronize(); baseline = median of the steps before any save",
        "baseline_step_s": base, "baseline_steps_s": baseline,
        "sync": {"blocking_s": sync["blocking_s"], "complete_s": sync.get("complete_s"), "bytes": sync_bytes,
                 "steps_after_s": after_sync, "step_time_cost_s": sync["blocking_s"] + excess(after_sync)},
        "async": {"blocking_s": async_entry["blocking_s"], "complete_s": async_entry.get("complete_s"),
                  "bytes": async_bytes, "background": async_entry.get("background"),
                  "steps_during_write": len(during), "steps_during_write_s": during,
                  "mean_excess_during_write_s": (excess(during) / len(during)) if during else 0.0,
                  "steps_after_s": after_async,
                  "step_time_cost_s": async_entry["blocking_s"] + excess(during) + excess(after_async)},
        "checkpoint_bytes_estimated": needed, "filesystem_free_bytes_before": free,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device_memory": cuda_memory(f"cuda:{torch.cuda.current_device()}"),
    }
    from lab.benchio import finish

    finish(result, args.out, omit=lambda k: k.endswith("steps_s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
