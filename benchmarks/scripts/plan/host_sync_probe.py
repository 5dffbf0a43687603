"""The host time of one megatron-core MoE layer's forward, the planner's ``scale.moe_sync_gap_s`` (GPU, one rank).

    python benchmarks/scripts/plan/host_sync_probe.py [--experts 16 --topk 8 --hidden 2048 --ffn 768] [--json FILE]

megatron-core's alltoall dispatcher reads the per-expert token counts back to the host before it sizes the
dispatch, so the host cannot queue work past a MoE layer's router: the planner prices a MoE layer's forward at
``max(its GPU work, scale.moe_sync_gap_s)`` (muse_stack/plan/scale.py). This builds one MoE layer of megatron-core
(TE spec, grouped GEMM, alltoall dispatcher, balanced routing where the installed megatron-core has
``moe_router_force_load_balancing``) on one GPU, with the shapes of one GPU's share of a published run (by default
Qwen3-30B-A3B at EP 8: 16 local experts, top-8 routing over them, hidden 2,048, expert FFN 768), and times its
forward with autograd recording, as training runs it, at token counts from 128 to 16,384. Per count it writes the
wall time of a forward (host and GPU, synchronised around a batch of forwards) and the GPU time of one (CUDA
events on an otherwise idle stream, the forward's kernels only when the host is ahead). Where the GPU time is far
below the wall time the layer is host-bound and the wall time is the term; where they meet the layer is GPU-bound
and the wall time follows the GPU work, which is the max the planner assumes. Needs megatron-core, Transformer
Engine and a CUDA GPU (the engine's image); it is not run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import fields
from pathlib import Path

TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build(args):
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
    kwargs = dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, num_query_groups=args.kv_heads,
                  kv_channels=args.hidden // args.heads, ffn_hidden_size=4 * args.hidden,
                  num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
                  moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="none", moe_permute_fusion=True, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm", bf16=True,
                  params_dtype=torch.bfloat16, bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
    names = {f.name for f in fields(TransformerConfig)}
    if "moe_router_force_load_balancing" in names:
        kwargs["moe_router_force_load_balancing"] = True
    config = TransformerConfig(**kwargs)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=args.experts, moe_grouped_gemm=True)
    layer = build_module(spec.submodules.mlp, config=config).cuda()
    return layer, "moe_router_force_load_balancing" in kwargs


def probe(layer, tokens: int, hidden: int, repeats: int, batch: int) -> dict:
    import torch

    x = torch.randn(tokens, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):  # warm-up: the kernels' first launches and autotuning
        layer(x)
    torch.cuda.synchronize()
    walls, gpus = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(batch):
            layer(x)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        layer(x)
        end.record()
        torch.cuda.synchronize()
        gpus.append(start.elapsed_time(end) / 1e3)
    return {"tokens": tokens, "wall_s": statistics.median(walls), "event_s": statistics.median(gpus),
            "walls_s": walls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=20, help="forwards per timed batch")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    layer, balanced = build(args)
    rows = [probe(layer, t, args.hidden, args.repeats, args.batch) for t in TOKENS]
    out = {"device": torch.cuda.get_device_name(0), "shapes": vars(args) | {"json": None},
           "balanced_routing": balanced, "rows": rows,
           # the host-bound floor: the wall time of the smallest forward, the planner's scale.moe_sync_gap_s
           "host_s": rows[0]["wall_s"]}
    for r in rows:
        print(f"{r['tokens']:6d} tokens: wall {r['wall_s'] * 1e3:8.3f} ms, events {r['event_s'] * 1e3:8.3f} ms")
    print(f"host time of a MoE layer's forward: {out['host_s'] * 1e3:.3f} ms ({out['device']})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
