"""The premises of the towers' parity bound, measured with the reference model alone on the CPU: how many expert
choices bf16 rounding flips with routing as initialised and with it pinned (``lab.verify.parity.PIN_STEP``), the
logits' relative RMS error of bf16 autocast against fp32 in both cases, that of an fp32 run whose word embeddings are
perturbed far below bf16's rounding (the chaotic regime), and that of the negative control's damage
(``lab.verify.parity.DEFECTS``) on the pinned model in bf16. ``benchmarks/scripts/towers_cpu_bound.py`` writes them;
``tests/lab/test_towers_bound.py`` checks them."""

from __future__ import annotations

from typing import Any

import torch

from lab.verify.parity import DEFECTS, SEQ, add_media, make_batch, pin_expert_choice, reference_args, tiny_recipe

#: the embedding perturbation of the chaotic-regime probe: relative, far below bf16's unit roundoff 2^-8
PERTURBATION = 2.0 ** -12


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def reference_on_cpu(pinned: bool):
    """The towers' parity model and its row, as lab.verify.parity builds them, on the CPU."""
    from muse_stack.models.muse_spark import MuseSparkForCausalLM

    recipe = tiny_recipe(towers=True)
    cfg, towers = recipe.model_config_resolved(), recipe.towers_config_resolved()
    batch = add_media(make_batch(cfg.vocab_size - 8, SEQ), towers)
    model = MuseSparkForCausalLM(cfg, seed=1234, towers=towers)
    if pinned:
        pin_expert_choice(model)
    return model, batch["input_ids"], reference_args(batch)


def forward(model, ids, args, bf16: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits (fp32) and each MoE layer's chosen experts (sorted per token)."""
    from muse_stack.models.muse_spark.router import MuseSparkRouter

    picks: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, o: picks.append(o.indices.sort(-1).values))
             for m in model.modules() if isinstance(m, MuseSparkRouter)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(ids, **args).logits.float()
    for h in hooks:
        h.remove()
    return logits, picks


def measure() -> dict[str, Any]:
    out: dict[str, Any] = {"seq_length": SEQ, "perturbation": PERTURBATION}
    for pinned in (False, True):
        model, ids, args = reference_on_cpu(pinned)
        exact, exact_picks = forward(model, ids, args, bf16=False)
        rounded, rounded_picks = forward(model, ids, args, bf16=True)
        key = "pinned" if pinned else "unpinned"
        out[key] = {"flipped_tokens_by_layer": [int((a != b).any(-1).sum()) for a, b in zip(exact_picks,
                                                                                              rounded_picks)],
                    "logits_rel_rms_bf16_vs_fp32": rel_rms(rounded, exact)}
        if not pinned:
            emb = model.model.language_model.embed_tokens.weight
            noise = torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                emb.mul_(1 + PERTURBATION * noise)
            perturbed, _ = forward(model, ids, args, bf16=False)
            out[key]["logits_rel_rms_perturbed_fp32_vs_fp32"] = rel_rms(perturbed, exact)
        else:
            (name, (suffix, factor)), = DEFECTS.items()
            params = [p for n, p in model.named_parameters() if n.endswith(suffix)]
            if len(params) != 1:
                raise SystemExit(f"defect {name}: {len(params)} reference parameters end with {suffix}")
            with torch.no_grad():
                params[0].mul_(factor)
            damaged, _ = forward(model, ids, args, bf16=True)
            out[key]["defect"] = name
            out[key]["defect_logits_rel_rms_bf16_vs_fp32"] = rel_rms(damaged, exact)
    return out


#: the premise of the trained-steps bound (tests/lab/test_benchmarks_megatron.py ``_check_trained_steps``): runs of the
#: pinned model trained alike but for their rounding. ``bf16``: autocast, the reference's own rounding; ``bf16-twice``:
#: autocast with every decoder layer's output rounded to bf16 once more, a stand-in for the engine (which rounds at
#: the reference's points and at most once more at each); ``bf16-seed-K``: autocast on embeddings moved by
#: ``PERTURBATION``, other samples of the same rounding's error; ``bf16-params``: autocast with every parameter rounded
#: to bf16 for the forward and the update applied to the fp32 value (megatron-core's bf16 parameters and fp32 main
#: parameters), where autocast rounds only a matmul's inputs
TRAINED_VARIANTS = ("bf16", "bf16-twice", "bf16-params", "bf16-seed-1", "bf16-seed-2", "bf16-seed-3")


class _RoundedForward(torch.nn.Module):
    """A parametrization: the forward reads the bf16 rounding of the parameter, the gradient reaches the fp32 value
    unchanged (straight through)."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (w.to(torch.bfloat16).to(w.dtype) - w).detach()


def _round_parameters(engine, recipe) -> None:
    """``bf16-params`` on a reference engine: every parameter parametrized by :class:`_RoundedForward`, and the
    optimizer rebuilt over the parametrized fp32 values as the engine's own (the recipe's AdamW and groups)."""
    from torch.nn.utils import parametrize

    from muse_stack.engines.reference import build_optimizer

    for module in list(engine.model.modules()):
        for name, _ in list(module.named_parameters(recurse=False)):
            parametrize.register_parametrization(module, name, _RoundedForward(), unsafe=True)
    engine.optimizer = build_optimizer(engine.model, recipe.optimizer)


def _reference_engine(recipe, model_cfg):
    from contextlib import nullcontext

    from muse_stack.engines.base import TrainContext
    from muse_stack.engines.reference import ReferenceEngine
    from muse_stack.resolve.recipe import finalize

    ctx = TrainContext(recipe=recipe, model=model_cfg, rank=0, world_size=1, local_rank=0,
                       resolved=finalize(recipe, gpus=1))
    engine = ReferenceEngine(ctx)
    pin_expert_choice(engine.model)
    engine.autocast = nullcontext()
    return engine


def _round_layer_outputs(model) -> list:
    """Hooks that round every decoder layer's output to bf16 (the engine's extra rounding, ``bf16-twice``)."""
    from muse_stack.models.muse_spark.decoder import MuseSparkDecoderLayer

    def hook(module, args, output):
        if torch.is_tensor(output):
            return output.to(torch.bfloat16).to(output.dtype)
        return (output[0].to(torch.bfloat16).to(output[0].dtype), *output[1:])

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, MuseSparkDecoderLayer)]


def measure_training(steps: int = 3) -> dict[str, Any]:
    """Each variant and an fp32 run train ``steps`` AdamW steps (the recipe's optimizer and schedule) on the row,
    every run from the reference's initialisation rounded to bf16, where the engine's masters start;
    per step each variant's loss against the fp32 run's (relative), and after each step but the last its logits
    against the fp32 run's (lab.verify.parity's ``logits_deviation``)."""
    from lab.verify.parity import _OneBatch, logits_deviation
    from muse_stack.run.steps import TrainSteps

    base = tiny_recipe(towers=True)
    recipe = base.model_copy(update={"precision": "fp32",
                                     "hardware": base.hardware.model_copy(update={"gpu": "cpu"})})
    cfg, towers = recipe.model_config_resolved(), recipe.towers_config_resolved()
    batch = add_media(make_batch(cfg.vocab_size - 8, SEQ), towers)
    args = reference_args(batch)
    runs: dict[str, Any] = {}
    for name in ("fp32", *TRAINED_VARIANTS):
        engine = _reference_engine(recipe, cfg)
        with torch.no_grad():  # every run starts where the engine's optimizer does: on the bf16 grid
            for p in engine.model.parameters():  # (lab.verify.parity.start_as_engine; bf16 parameters throughout)
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
        if name != "fp32":
            engine.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        if name == "bf16-twice":
            _round_layer_outputs(engine.model)
        if name == "bf16-params":
            _round_parameters(engine, recipe)
        if name.startswith("bf16-seed-"):
            emb = engine.model.model.language_model.embed_tokens.weight
            noise = torch.randn(emb.shape, generator=torch.Generator().manual_seed(int(name.rsplit("-", 1)[1])))
            with torch.no_grad():
                emb.mul_(1 + PERTURBATION * noise)
        driven = TrainSteps(engine, recipe, _OneBatch(batch), steps)
        losses, logits = [], []
        for s in range(1, steps + 1):
            losses.append(driven.step(s).loss)
            if s < steps:
                with torch.no_grad(), engine.autocast:
                    logits.append(engine.model(batch["input_ids"], **args).logits.float())
        runs[name] = (losses, logits)
    exact_losses, exact_logits = runs["fp32"]
    out: dict[str, Any] = {"steps": steps, "fp32_losses": exact_losses, "variants": {}}
    for name in TRAINED_VARIANTS:
        losses, logits = runs[name]
        after = [{"after_step": s, "logits_rel_rms_vs_fp32":
                  logits_deviation(z, z, z32, batch["labels"])["logits_rel_rms_megatron_vs_fp32"]}
                 for s, (z, z32) in enumerate(zip(logits, exact_logits), start=1)]
        out["variants"][name] = {"losses": losses, "after": after,
                                 "loss_rel_diff_vs_fp32": [abs(a - b) / b for a, b in zip(losses, exact_losses)]}
    return out
