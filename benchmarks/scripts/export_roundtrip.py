"""Export round trip on a GPU: a megatron-engine run's dist-checkpoint, exported with
``muse-stack export RUN --hf OUT``, read back two ways.

1. Tensors: every parameter of the engine, loaded from the run's latest checkpoint, against
   the exported tensor read through the weight mapping (the same per-rank slice reader that
   ``model.pretrained_checkpoint`` uses). The export copies the stored bf16 weights, so each
   must be bit-for-bit equal.
2. Logits: the reference model loaded from the export (fp32 and bf16 autocast) against the
   engine's own logits on the run's weights, on one micro-batch of the run's data. The
   engine (bf16) must sit within 1.5x of the reference's own bf16 noise floor (reference in
   bf16 against reference in fp32, same weights, same tokens).

    PYTHONPATH=. python benchmarks/scripts/export_roundtrip.py RUN_DIR EXPORT_DIR --out roundtrip.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("export_dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from muse_stack.engines.megatron_available import require_megatron

    require_megatron()
    from muse_stack.data import build_for_recipe
    from lab.engine import eval_logits
    from muse_stack.engines.base import TrainContext
    from muse_stack.resolve.recipe import finalize
    from muse_stack.engines.mcore.load import checkpoint_getter, read_rank_weights
    from muse_stack.engines.megatron import MegatronEngine
    from muse_stack.models.muse_spark.checkpoint import load_checkpoint
    from muse_stack.recipes.catalogue import parse_recipe
    from muse_stack.run import checkpoints
    from muse_stack.run.steps import TrainSteps

    current = checkpoints.latest(Path(args.run_dir))
    if current is None:
        raise SystemExit(f"{args.run_dir} has no complete checkpoint")
    recipe = parse_recipe(yaml.safe_load(current.recipe_text()), str(current.path))
    cfg = recipe.model_config_resolved()
    data = build_for_recipe(recipe, progress=False)
    total = recipe.training.steps or current.step
    engine = MegatronEngine(TrainContext(recipe=recipe, model=cfg, resolved=finalize(recipe, gpus=1)))
    steps = TrainSteps(engine, recipe, data, total)
    # the weights, and the data where the checkpoint left it (its random state is not needed here)
    checkpoints.CheckpointManager(Path(args.run_dir), engine, interval=None, keep=None,
                                  states={"data": steps.data}).load(total)

    # 1. tensors, bit for bit
    params = dict(engine.model.module.named_parameters())
    params.update({n: b for n, b in engine.model.module.named_buffers() if n.endswith("router.expert_bias")})
    equal, mismatched = 0, []
    for name, target, part in read_rank_weights(checkpoint_getter(args.export_dir), list(params),
                                                **engine.load_kwargs):
        mine = params[name].detach()
        theirs = part.to(device=mine.device)
        if theirs.dtype == mine.dtype and theirs.shape == mine.shape and torch.equal(theirs, mine):
            equal += 1
        else:
            diff = float((theirs.double() - mine.double()).abs().max()) if theirs.shape == mine.shape else None
            mismatched.append({"name": name, "hf": target.hf_name, "dtype": [str(mine.dtype), str(theirs.dtype)],
                               "max_abs_diff": diff})

    # 2. logits on one micro-batch of the run's data
    mb = next(steps.data.stream)
    mine = eval_logits(engine, mb)
    del engine
    torch.cuda.empty_cache()
    device = torch.device("cuda", 0)
    reference = load_checkpoint(args.export_dir, dtype=torch.float32, device=device)
    on = {k: v.to(device) for k, v in mb.items() if torch.is_tensor(v)}
    kwargs = {k: on[k] for k in ("position_ids", "segment_ids", "labels", "loss_mask") if k in on}
    with torch.no_grad():
        ref32 = reference(on["input_ids"], **kwargs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref16 = reference(on["input_ids"], **kwargs)
    floor = _rel_rms(ref16.logits, ref32.logits)
    engine_vs_fp32 = _rel_rms(mine, ref32.logits)
    result = {
        "run_dir": args.run_dir, "export_dir": args.export_dir, "recipe": recipe.name, "step": current.step,
        "device": torch.cuda.get_device_name(), "layout": {"tp": recipe.layout.tp, "pp": recipe.layout.pp,
                                                           "ep": recipe.layout.ep or 1},
        "tensors_compared": equal + len(mismatched), "tensors_bitwise_equal": equal, "mismatched": mismatched,
        "logits_tokens": int(on["input_ids"].numel()),
        "logits_rms_fp32": float(ref32.logits.double().pow(2).mean().sqrt()),
        "logits_rel_rms_engine_bf16_vs_reference_fp32": engine_vs_fp32,
        "logits_rel_rms_reference_bf16_vs_fp32": floor,
        "logits_max_abs_engine_vs_reference_fp32": float((mine.double() - ref32.logits.double()).abs().max()),
        "criterion": "tensors all bitwise equal; engine logits within 1.5x the reference's bf16 noise floor",
    }
    result["passed"] = not mismatched and engine_vs_fp32 <= 1.5 * floor
    from lab.benchio import finish

    finish(result, args.out, omit=lambda k: k == "mismatched")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
