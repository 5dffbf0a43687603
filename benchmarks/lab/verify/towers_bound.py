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
