"""The host time of one megatron-core MoE layer's forward and backward, the planner's host term (GPU, one rank).

    python benchmarks/scripts/plan/host_sync_probe.py [--model qwen3-30b-a3b ...] [--precision bf16 fp8-cs]
        [--json FILE]

megatron-core's alltoall dispatcher reads the per-expert token counts back to the host before it sizes the
dispatch, so the host cannot queue work past a MoE layer's router, and a layer whose host work outlasts its GPU work
leaves the GPU idle. The planner prices a MoE layer's forward at ``max(its GPU work, its host time)``
(muse_stack/plan/scale.py). This builds one MoE layer of megatron-core (TE spec, grouped GEMM, alltoall dispatcher,
no CUDA graphs, balanced routing where the installed megatron-core has ``moe_router_force_load_balancing``) on one
GPU, with the shapes of one GPU's share of a published run (a model of muse_stack/plan/published/bridge-moe.yaml at
expert parallelism ``--ep``: its local experts, its top-k over them, its hidden and expert FFN widths), and times
it as training runs it, at token counts from 128 to 16,384:
- ``fwd``: a forward with autograd recording;
- ``fwd_bwd``: a forward and its backward.
Per count it writes the wall time (host and GPU, synchronised around a batch) and the GPU time of one (CUDA events;
the kernels alone only where the host is ahead). At the smallest count the GPU work is a fraction of the wall time,
so the wall time is the host's: ``host_fwd_s`` and ``host_bwd_s`` (fwd_bwd less fwd) are the floors the planner
takes. Under ``fp8-cs`` the layer runs inside TransformerEngine's ``fp8_autocast`` with current scaling, as the
FP8-CS runs do. ``--block layer`` times the whole decoder layer instead (TE attention, causal, no RoPE, then the
MoE block): the attention block's host work, which the MoE block's figures leave out. Its attention is one generic
GQA block (32 heads, 4 query groups, 128 channels) for every model, or with ``--attention model`` the model's own
where it is GQA (its heads, query groups and head width, and the settings of :data:`MODEL_SETTINGS`: Qwen3's
query-key norms; GPT-OSS's sink logits, biases and clamped quick-GEGLU experts, and with ``--window sliding`` its
128-key window), so that, at token counts where the GPU outlasts the host, a layer's GPU time is measured with the
model's own kernels. Also written:
the host CPU (``lscpu``'s model name) and the installed torch, TE and megatron-core.
Needs megatron-core, Transformer Engine and a CUDA GPU (the engine's image); it is not run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import fields
from pathlib import Path

TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: each GQA model's megatron-core settings besides its widths, as Megatron-Bridge's providers give them
#: (src/megatron/bridge/models/qwen/qwen_provider.py at 07d0d14ac, Qwen3MoEModelProvider;
#: src/megatron/bridge/models/gpt_oss/gpt_oss_provider.py at 12bc34a8e, GPTOSSProvider); "sliding" is GPT-OSS's
#: window, on its sliding layers only (window_attn_skip_freq 2)
MODEL_SETTINGS = {
    "qwen3-30b-a3b": {"qk_layernorm": True},
    "qwen3-235b-a22b": {"qk_layernorm": True},
    "gpt-oss-120b": {"softmax_type": "learnable", "add_bias_linear": True, "glu_linear_offset": 1.0,
                     "activation_func_clamp_value": 7.0, "bias_activation_fusion": True, "quick_gelu": True,
                     "sliding": (128, 0)},
}


def model_shape(name: str, ep: int) -> dict:
    """One GPU's MoE layer of a published model at expert parallelism ``ep`` (bridge-moe.yaml's shapes)."""
    from muse_stack.plan.published import load

    shape = load().models[name]
    if shape.num_experts % ep:
        raise SystemExit(f"--ep {ep} does not divide {name}'s {shape.num_experts} experts")
    return {"model": name, "ep": ep, "experts": shape.num_experts // ep,
            "topk": min(shape.experts_per_token, shape.num_experts // ep), "hidden": shape.hidden_size,
            "ffn": shape.moe_ffn_hidden_size, "attention": shape.attention, "heads": shape.num_attention_heads,
            "query_groups": shape.num_key_value_heads, "head_dim": shape.head_dim}


def model_attention(s: dict, window: str, names: set[str]) -> tuple[dict, dict]:
    """The TransformerConfig keywords of the model's own attention (and its experts' activation, biases) for
    ``--attention model``, and what was set, by name (a setting this megatron-core lacks is refused)."""
    if s["attention"] != "gqa":
        raise SystemExit(f"--attention model builds GQA attention; {s['model']} has {s['attention']}: use "
                         "--attention generic")
    settings = dict(MODEL_SETTINGS.get(s["model"], {}))
    sliding = settings.pop("sliding", None)
    if window == "sliding" and sliding is None:
        raise SystemExit(f"--window sliding: {s['model']} has no sliding window")
    kwargs = dict(num_attention_heads=s["heads"], num_query_groups=s["query_groups"], kv_channels=s["head_dim"])
    if settings.pop("quick_gelu", False):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kwargs["activation_func"] = quick_gelu
    kwargs |= settings
    if window == "sliding":
        kwargs["window_size"] = sliding
    missing = sorted(set(kwargs) - names)
    if missing:
        raise SystemExit(f"this megatron-core's TransformerConfig has no {', '.join(missing)}: it cannot build "
                         f"{s['model']}'s attention")
    return kwargs, {k: (v.__name__ if callable(v) else v) for k, v in kwargs.items()}


def build(s: dict, precision: str, block: str = "moe", attention: str = "generic", window: str = "full"):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl", world_size=1, rank=0)
        torch.cuda.set_device(0)
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
    heads = 32
    kwargs = dict(num_layers=1, hidden_size=s["hidden"], num_attention_heads=heads, num_query_groups=4,
                  kv_channels=128, ffn_hidden_size=4 * s["hidden"], num_moe_experts=s["experts"],
                  moe_router_topk=s["topk"], moe_ffn_hidden_size=s["ffn"], moe_grouped_gemm=True,
                  moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                  moe_permute_fusion=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  normalization="RMSNorm", bf16=True, params_dtype=torch.bfloat16, bias_dropout_fusion=False,
                  hidden_dropout=0.0, attention_dropout=0.0)
    if precision == "fp8-cs":
        kwargs |= dict(fp8="e4m3", fp8_recipe="tensorwise")
    names = {f.name for f in fields(TransformerConfig)}
    if "moe_router_force_load_balancing" in names:
        kwargs["moe_router_force_load_balancing"] = True
    own: dict = {}
    if block == "layer" and attention == "model":
        extra, own = model_attention(s, window, names)
        kwargs |= extra
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=s["experts"], moe_grouped_gemm=True,
                                                      qk_layernorm=bool(kwargs.get("qk_layernorm")))
    build.settings = own  # what --attention model set, for the record
    if block == "layer":  # the whole decoder layer: the attention block (TE, causal, no RoPE) and the MoE block
        layer = build_module(spec, config=config, layer_number=1).cuda()
        return layer, "moe_router_force_load_balancing" in kwargs
    mlp = spec.submodules.mlp  # a ModuleSpec, or (megatron-core 0.19) a partial of MoELayer with its submodules
    layer = (mlp(config=config) if callable(mlp) and not isinstance(mlp, type) else build_module(mlp, config=config)).cuda()
    return layer, "moe_router_force_load_balancing" in kwargs


def autocast(precision: str):
    import contextlib

    if precision != "fp8-cs":
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    return te.fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling())


def probe(layer, tokens: int, hidden: int, precision: str, repeats: int, batch: int) -> dict:
    import torch

    x = torch.randn(tokens, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def fwd():
        with autocast(precision):
            return layer(x)[0]

    def fwd_bwd():
        fwd().backward(grad)

    out = {"tokens": tokens}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        for _ in range(3):  # warm-up: the kernels' first launches and autotuning
            fn()
        torch.cuda.synchronize()
        walls, gpus = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / batch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            gpus.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_wall_s"] = statistics.median(walls)
        out[f"{name}_event_s"] = statistics.median(gpus)
        out[f"{name}_walls_s"] = walls
    return out


def host_cpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), "unknown")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformer_engine", "transformer_engine_torch", "megatron-core"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3-30b-a3b"], help="models of bridge-moe.yaml")
    ap.add_argument("--ep", type=int, nargs="+", default=[8], help="expert parallelism: the local experts are experts / ep")
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=["bf16", "fp8-cs"])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts, the smallest first")
    ap.add_argument("--block", choices=["moe", "layer"], default="moe",
                    help="the MoE block alone (the planner's figures), or the whole decoder layer with its attention")
    ap.add_argument("--attention", choices=["generic", "model"], default="generic",
                    help="with --block layer: one generic GQA block, or the model's own (GQA models)")
    ap.add_argument("--window", choices=["full", "sliding"], default="full",
                    help="with --attention model: a full-attention layer, or a sliding-window one")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=20, help="passes per timed batch")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    probes = []
    for model, ep in ((m, e) for m in args.model for e in args.ep):
        s = model_shape(model, ep)
        for precision in args.precision:
            layer, balanced = build(s, precision, args.block, args.attention, args.window)
            rows = [probe(layer, t, s["hidden"], precision, args.repeats, args.batch) for t in sorted(args.tokens)]
            first = rows[0]
            one = {"shape": s, "precision": precision, "balanced_routing": balanced, "rows": rows,
                   "attention": ({"kind": "model", "window": args.window, "settings": build.settings}
                                 if args.block == "layer" and args.attention == "model" else
                                 {"kind": "generic GQA: 32 heads, 4 query groups, 128 channels"}
                                 if args.block == "layer" else None),
                   # the host-bound floors at the smallest count: the planner's host time of a layer's passes
                   "host_fwd_s": first["fwd_wall_s"], "host_bwd_s": first["fwd_bwd_wall_s"] - first["fwd_wall_s"],
                   "gpu_share_at_floor": first["fwd_bwd_event_s"] / first["fwd_bwd_wall_s"]}
            probes.append(one)
            for r in rows:
                print(f"{model} ep{ep} {precision} {r['tokens']:6d} tokens: fwd wall {r['fwd_wall_s'] * 1e3:7.3f} ms "
                      f"(events {r['fwd_event_s'] * 1e3:7.3f}); fwd+bwd wall {r['fwd_bwd_wall_s'] * 1e3:7.3f} ms "
                      f"(events {r['fwd_bwd_event_s'] * 1e3:7.3f})")
            print(f"{model} ep{ep} {precision}: host fwd {one['host_fwd_s'] * 1e3:.3f} ms, bwd {one['host_bwd_s'] * 1e3:.3f} ms")
            del layer
            torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(0), "host_cpu": host_cpu(), "cpu_count": os.cpu_count(),
           "versions": versions(), "block": args.block, "repeats": args.repeats, "batch": args.batch,
           "cuda_graphs": [], "dispatcher": "alltoall", "probes": probes}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
