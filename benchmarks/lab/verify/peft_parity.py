"""Adapters, same weights, same tokens: the megatron-core engine's LoRA/DoRA against the
reference engine's (one GPU, TP 1).

``python -m lab.verify.peft_parity [--scheme lora|dora] [--out FILE]``

The parity model of :mod:`.parity` (every Muse Spark feature, small) gets adapters on every
target the scheme allows (LoRA: attention, latent projections and one adapter per routed
expert; DoRA: attention). Three checks:

1. **float32 forward and adapter gradients.** The reference model (seeded base, adapters as
   :func:`muse_stack.models.muse_spark.peft.apply_peft` makes them, then B set to seeded non-zero values so
   that the adapters change the output and A gets a gradient) against the engine built with
   ``precision: fp32`` from the same base and adapter tensors through the weight mapping. The
   logits, the loss and the gradient of every adapter tensor (relative error per tensor, the
   engine's expert adapters gathered back into the reference's stacked tensors) are compared,
   with the reference in float64 as the yardstick: the engine must be as close to float64 as
   the float32 reference is, within a factor (see :data:`FP32_FACTOR`).
2. **What trains.** The engine's optimizer holds only adapter parameters, and its gradient
   buffers are the adapters' size.
3. **bf16 training.** Both engines from the seeded base and their own initial adapters (B = 0,
   the same A), 3 AdamW steps on the same batch in bf16; the per-step losses are compared.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from muse_stack.engines.base import TrainContext
from muse_stack.resolve.recipe import finalize
from lab.verify.parity import SEQ, make_batch, tiny_recipe
from muse_stack.recipes.catalogue import parse_recipe

#: Both float32 computations (the reference's and the engine's) round differently from the
#: float64 one, by accumulated relative errors of order sqrt(K) x 2^-24 over the K-term sums of
#: each GEMM, through the same depth of layers. Different kernels (TE's GEMMs and fused
#: attention vs PyTorch's) change the constants, not the order: the engine's distance to float64
#: must stay within this factor of the float32 reference's own distance. A formula error or a
#: TF32 GEMM (2^-11 mantissa) lands orders of magnitude above.
FP32_FACTOR = 16.0

LORA_TARGETS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.pre_expert_proj", "mlp.post_expert_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
DORA_TARGETS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]


def peft_recipe(scheme: str, precision: str):
    doc = tiny_recipe().model_dump(mode="json")
    doc["precision"] = precision
    doc["peft"] = {"scheme": scheme, "rank": 8, "alpha": 16.0, "dropout": 0.0,
                   "targets": LORA_TARGETS if scheme == "lora" else DORA_TARGETS,
                   "per_expert": True if scheme == "lora" else None}
    return parse_recipe(doc, f"peft-parity-{scheme}-{precision}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.pow(2).mean().sqrt()
    return float((a - b).pow(2).mean().sqrt() / den) if den > 0 else float((a - b).abs().max())


def _reference_with_adapters(cfg, settings, seed: int, dtype: torch.dtype, device):
    from muse_stack.models.muse_spark import MuseSparkForCausalLM
    from muse_stack.models.muse_spark.peft import adapter_state_dict, apply_peft

    model = MuseSparkForCausalLM(cfg, seed=seed)
    apply_peft(model, settings, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B non-zero (seeded), scaled to perturb each projection by a few percent
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.to(device=device, dtype=dtype), adapter_state_dict(model)


def _forward_backward_reference(model, batch, device):
    on = {k: v.to(device) for k, v in batch.items() if torch.is_tensor(v)}
    model.zero_grad(set_to_none=True)
    out = model(on["input_ids"], position_ids=on["position_ids"], segment_ids=on["segment_ids"], labels=on["labels"],
                loss_mask=on["loss_mask"])
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), float(out.loss), grads


def _engine_adapter_grads(engine, batch) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """The engine's loss and adapter gradients (main_grad of megatron-core's DDP) on ``batch``."""
    from muse_stack.engines.mcore.peft import mcore_to_reference

    from lab.verify.parity import engine_forward_backward

    logits, loss = engine_forward_backward(engine, batch)
    grads: dict[str, torch.Tensor] = {}
    off = engine.load_kwargs
    for name, p in engine.model.module.named_parameters():
        if not p.requires_grad:
            continue
        g = getattr(p, "main_grad", None)
        g = g if g is not None else p.grad
        where = mcore_to_reference(name, layer_offset=off["layer_offset"], expert_offset=off["expert_offset"])
        grads[name] = (where, g.detach().float().clone())
    return logits, loss, grads


def _stack_engine_grads(engine_grads, reference_grads) -> dict[str, torch.Tensor]:
    """The engine's adapter gradients in the reference's names and shapes (experts stacked)."""
    out: dict[str, torch.Tensor] = {}
    for _, (where, g) in engine_grads.items():
        ref = reference_grads[where.hf_name]
        if where.expert is None:
            out[where.hf_name] = g
        else:
            full = out.setdefault(where.hf_name, torch.full(ref.shape, float("nan"), device=g.device))
            full[where.expert if ref.shape[0] > 1 else 0] = g
    return out


def run(scheme: str = "lora", seed: int = 1234, train_steps: int = 3) -> dict[str, Any]:
    from muse_stack.engines.megatron_available import require_megatron

    require_megatron()
    from lab.engine import LoadedEngine
    from lab.verify.parity import _train
    from muse_stack.models.muse_spark.peft import base_state_dict
    from muse_stack.models.muse_spark.peft_config import resolve

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    recipe32 = peft_recipe(scheme, "fp32")
    cfg = recipe32.model_config_resolved()
    settings = resolve(recipe32.peft, cfg)
    batch = make_batch(cfg.vocab_size, SEQ)

    # 1. float32 forward and gradients; float64 reference as the yardstick
    ref64, adapters = _reference_with_adapters(cfg, settings, seed, torch.float64, device)
    logits64, loss64, grads64 = _forward_backward_reference(ref64, batch, device)
    base = {k: v.float().cpu() for k, v in base_state_dict(ref64).items()}
    del ref64
    ref32, _ = _reference_with_adapters(cfg, settings, seed, torch.float32, device)
    logits32, loss32, grads32 = _forward_backward_reference(ref32, batch, device)
    del ref32
    ctx = TrainContext(recipe=recipe32, model=cfg, resolved=finalize(recipe32, gpus=1))
    engine = LoadedEngine(ctx, base, {k: v.float() for k, v in adapters.items()})
    mine_logits, mine_loss, mine = _engine_adapter_grads(engine, batch)
    stacked = _stack_engine_grads(mine, grads64)

    tensors = []
    for name, g64 in grads64.items():
        e = stacked.get(name)
        row = {"name": name, "shape": list(g64.shape), "reference_fp32_vs_fp64": _rel(grads32[name], g64),
               "engine_fp32_vs_fp64": _rel(e, g64) if e is not None and not torch.isnan(e).any() else None}
        row["limit"] = FP32_FACTOR * row["reference_fp32_vs_fp64"]
        row["passed"] = row["engine_fp32_vs_fp64"] is not None and row["engine_fp32_vs_fp64"] <= row["limit"]
        tensors.append(row)
    logits = {"reference_fp32_vs_fp64": _rel(logits32, logits64), "engine_fp32_vs_fp64": _rel(mine_logits, logits64),
              "max_abs_engine_fp32_vs_fp64": float((mine_logits.double() - logits64.double()).abs().max()),
              "rms_fp64": float(logits64.double().pow(2).mean().sqrt())}
    logits["passed"] = logits["engine_fp32_vs_fp64"] <= FP32_FACTOR * logits["reference_fp32_vs_fp64"]

    # 2. what reaches the optimizer
    trainable = [n for n, p in engine.model.module.named_parameters() if p.requires_grad]
    in_optimizer = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    buffer_numel = sum(b.grad_data.numel() for b in engine.model.buffers + engine.model.expert_parallel_buffers)
    adapter_numel = sum(p.numel() for n, p in engine.model.module.named_parameters() if ".adapter." in n)
    trains = {"trainable_tensors": len(trainable), "all_adapters": all(".adapter." in n for n in trainable),
              "optimizer_tensors": in_optimizer, "grad_buffer_numel": buffer_numel, "adapter_numel": adapter_numel,
              "base_numel": sum(p.numel() for n, p in engine.model.module.named_parameters() if ".adapter." not in n)}
    trains["passed"] = trains["all_adapters"] and buffer_numel >= adapter_numel and \
        buffer_numel < adapter_numel + 64 * len(trainable)  # bucket padding only
    del engine
    torch.cuda.empty_cache()
    import megatron.core.parallel_state as ps

    ps.destroy_model_parallel()

    # 3. bf16 training from the seeded base and the initial adapters
    recipe16 = peft_recipe(scheme, "bf16")
    from muse_stack.models.muse_spark import MuseSparkForCausalLM

    seeded = {k: v.clone() for k, v in MuseSparkForCausalLM(cfg, seed=seed).state_dict().items()}
    ctx16 = TrainContext(recipe=recipe16, model=cfg, resolved=finalize(recipe16, gpus=1))
    engine16 = LoadedEngine(ctx16, seeded)
    training = _train(engine16, recipe16, cfg, batch, train_steps, 0)

    result = {"scheme": scheme, "settings": settings.as_dict(), "device": torch.cuda.get_device_name(),
              "seq_length": SEQ, "fp32_factor": FP32_FACTOR,
              "loss": {"fp64": loss64, "reference_fp32": loss32, "engine_fp32": mine_loss},
              "logits": logits, "adapter_gradients": tensors, "trains": trains, "bf16_training": training}
    result["passed"] = logits["passed"] and all(t["passed"] for t in tensors) and trains["passed"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", choices=["lora", "dora"], default="lora")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = run(args.scheme, train_steps=args.train_steps)
    from lab.benchio import finish

    finish(result, args.out, omit=lambda k: k == "adapter_gradients")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
