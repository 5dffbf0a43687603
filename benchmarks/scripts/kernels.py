"""GPU time of slice-1gpu's largest memory-bound passes, each alone at the slice's shapes, and the
variants that could replace them:

* the experts' SwiGLU on [131072, 8192] bf16 (top-8 of 32 experts over 16,384 tokens): megatron-core's
  compiled ``bias_swiglu_impl``, Transformer Engine's ``ops.SwiGLU``, and the engine's (megatron-core's
  forward, TE's ``dswiglu`` backward), forward and backward;
* the post-expert norm and routing weight (``chains.weighted_gain_first_norm``) on [131072, 4096],
  compiled by TorchInductor as the engine compiles it, with Inductor's mix-order reduction (the
  weight-gradient column sum fused into the row pass) forced past its size checks, and with
  Inductor's multi-kernel (persistent row passes up to 16,384 columns), with and without it, and the
  candidate one-pass Triton backward (``muse_stack/engines/mcore/norm_backward.py``);
* TE's multi-tensor Adam with fp32 master weights (megatron-core's precision-aware optimizer) over one
  MoE layer's expert weights (1.61 B parameters), at TE's chunk size and two larger ones, and the same
  FusedAdam stepped by the engine's one-launch Triton step (``muse_stack/engines/mcore/adam_step.py``)
  over a grid of launches;
* zeroing a fp32 buffer of the slice's 4,328,521,728 parameters (megatron-core's ``zero_grad_buffer``).

Each is timed with CUDA events: 3 warm-up calls, then the median of 10. Each variant also lists the
kernels of one call (torch.profiler), with their times. ``min_bytes`` is what the pass must read and
write at least; ``gb_per_s`` divides it by the median time.

    PYTHONPATH=/tmp/site:. python benchmarks/scripts/kernels.py --out kernels.json [--only post_expert_norm ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

ROWS, LATENT, FFN = 131072, 4096, 4096  # slots (16,384 tokens x top-8), expert input width, expert FFN width
SLICE_PARAMS = 4_328_521_728


def _time(fn: Callable[[Any], Any], setup: Callable[[], Any] = lambda: None, reps: int = 10,
          warmup: int = 3) -> dict[str, Any]:
    """``fn(setup())`` timed; ``setup`` runs outside the timed region (fresh inputs for a pass that
    consumes its own)."""
    for _ in range(warmup):
        fn(setup())
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        arg = setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(arg)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    from torch.profiler import ProfilerActivity, profile

    arg = setup()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(arg)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels[e.name[:100]] = kernels.get(e.name[:100], 0.0) + e.device_time / 1e3
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps,
            "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def _rate(row: dict[str, Any], min_bytes: float) -> dict[str, Any]:
    row["min_bytes"] = min_bytes
    row["gb_per_s"] = min_bytes / (row["median_ms"] / 1e3) / 1e9
    return row


def swiglu() -> dict[str, Any]:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    import transformer_engine.pytorch as te

    from muse_stack.engines.mcore.layers import SwiGLUTEBackward

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(ROWS, 2 * FFN, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(ROWS, FFN, device="cuda", dtype=torch.bfloat16, generator=gen)
    e = 2  # bytes per bf16
    fwd_bytes = ROWS * (2 * FFN + FFN) * e  # read x, write y
    bwd_bytes = ROWS * (2 * FFN + FFN + 2 * FFN) * e  # read x and g, write dx
    out = {}
    for name, fn in (("megatron-core bias_swiglu_impl (compiled)", lambda t: bias_swiglu_impl(t, None)),
                     ("transformer_engine ops.SwiGLU", te.ops.SwiGLU()),
                     ("the engine's: megatron-core's forward, TE's dswiglu backward", SwiGLUTEBackward.apply)):

        def fwd(_):
            with torch.no_grad():
                fn(x)

        def fresh():  # TE's backward releases the input it saved: each pass gets its own copy
            return x.clone().requires_grad_()

        def fwd_bwd(xi):
            fn(xi).backward(g)

        f, fb = _rate(_time(fwd), fwd_bytes), _time(fwd_bwd, fresh)
        out[name] = {"forward": f, "forward_and_backward": fb,
                     "backward_ms": fb["median_ms"] - f["median_ms"],
                     "backward_gb_per_s": bwd_bytes / ((fb["median_ms"] - f["median_ms"]) / 1e3) / 1e9}
        torch.cuda.empty_cache()
    return out


#: the one-pass backward's launches timed: (programs per SM, warps, rows per iteration); the same grid
#: tests/gpu/test_norm_backward_gpu.py checks for correctness
LAUNCHES = [(per_sm, warps, tile) for per_sm in (1, 2, 4) for warps in (8, 16) for tile in (1, 2, 4)]


def post_expert_norm() -> dict[str, Any]:
    import torch._dynamo
    import torch._inductor.config as inductor

    from muse_stack.engines.mcore.chains import weighted_gain_first_norm

    fn = weighted_gain_first_norm.__wrapped__
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(ROWS, LATENT, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(LATENT, device="cuda", generator=gen) * 0.1
    p = torch.rand(ROWS, device="cuda", generator=gen)
    g = torch.randn(ROWS, LATENT, device="cuda", dtype=torch.bfloat16, generator=gen)
    fwd_bytes = ROWS * LATENT * 2 * 2  # read x, write y (bf16)
    bwd_bytes = ROWS * LATENT * 2 * 3  # read x and g, write dx
    out = {}
    variants = {"inductor default": {},
                "mix-order reduction forced (non-strict)": {"triton.mix_order_reduction": True,
                                                            "triton.mix_order_reduction_non_strict_mode": True},
                # 16x the persistent-reduction width (4,096 columns qualify), the faster of the two kernels
                # picked by benchmarking at the first call; mix-order fusion needs a persistent row pass
                "multi-kernel": {"triton.multi_kernel": 1},
                "multi-kernel, mix-order forced": {"triton.multi_kernel": 1, "triton.mix_order_reduction": True,
                                                   "triton.mix_order_reduction_non_strict_mode": True}}
    from muse_stack.engines.mcore import norm_backward

    def forward_and_backward(norm) -> dict[str, Any]:
        """``norm``'s forward alone, then its backward alone (the graph kept from one forward)."""
        xi, wi, pi = x.detach().requires_grad_(), w.detach().requires_grad_(), p.detach().requires_grad_()
        y = norm(xi, wi, pi, 1e-8)
        y.backward(g, retain_graph=True)  # a compiled norm compiles its backward here, under the same settings

        def fwd(_):
            with torch.no_grad():
                norm(xi, wi, pi, 1e-8)

        def bwd(_):
            xi.grad = wi.grad = pi.grad = None
            y.backward(g, retain_graph=True)

        return {"forward": _rate(_time(fwd), fwd_bytes), "backward": _rate(_time(bwd), bwd_bytes)}

    for name, patch in variants.items():
        torch._dynamo.reset()
        with inductor.patch(patch):
            out[name] = forward_and_backward(torch.compile(fn, dynamic=None))
    torch._dynamo.reset()
    # the candidate: the same compiled forward, the backward in one Triton pass
    out["one Triton pass (norm_backward.py), a candidate"] = forward_and_backward(norm_backward.weighted_gain_first_norm)
    # its launch: programs per SM x warps per program x rows per iteration, the backward alone
    # (benchmarks/scripts/normbwd_choose.py takes the fastest)
    xi, wi, pi = x.detach(), w.detach(), p.detach()
    out["one Triton pass, launches (backward alone)"] = launches = []
    for per_sm, warps, tile in LAUNCHES:
        row = _rate(_time(lambda _: norm_backward.backward(xi, wi, pi, g, 1e-8, programs_per_sm=per_sm,
                                                           num_warps=warps, rows_per_iteration=tile)), bwd_bytes)
        launches.append({"programs_per_sm": per_sm, "num_warps": warps, "rows_per_iteration": tile, "backward": row})
    return out


#: the Triton Adam step's launches timed: programs per SM x warps x elements per iteration
ADAM_LAUNCHES = [(per_sm, warps, block) for per_sm in (4, 8, 16, 32) for warps in (4, 8) for block in (512, 1024, 2048)]


def adam() -> dict[str, Any]:
    from transformer_engine.pytorch.optimizers import FusedAdam
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier

    shapes = [(2 * FFN, LATENT)] * 32 + [(LATENT, FFN)] * 32  # one MoE layer's experts: fc1 and fc2
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    for prm in params:
        prm.decoupled_grad = torch.randn(prm.shape, device="cuda", dtype=torch.float32) * 1e-3
    n = sum(prm.numel() for prm in params)
    opt = FusedAdam(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, master_weights=True,
                    use_decoupled_grad=True)
    per_param = 4 + 4 * 3 * 2 + 2  # read the fp32 grad; read and write the fp32 master, m, v; write the bf16 weight
    default = multi_tensor_applier.chunk_size
    out = {"parameters": n, "default_chunk_size": default}
    try:
        for chunk in (default, 4 * default, 16 * default):
            multi_tensor_applier.chunk_size = chunk
            row = _rate(_time(lambda _: opt.step(), reps=5, warmup=2), n * per_param)
            row["slice_ms_at_this_rate"] = row["median_ms"] * SLICE_PARAMS / n
            out[f"chunk {chunk}"] = row
    finally:
        multi_tensor_applier.chunk_size = default
    from muse_stack.engines.mcore import adam_step

    shipped = (adam_step.PROGRAMS_PER_SM, adam_step.NUM_WARPS, adam_step.BLOCK)
    launches = out["one Triton launch, launches"] = []
    try:
        for per_sm, warps, block in ADAM_LAUNCHES:
            adam_step.PROGRAMS_PER_SM, adam_step.NUM_WARPS, adam_step.BLOCK = per_sm, warps, block
            row = _rate(_time(lambda _: adam_step.step(opt), reps=5, warmup=2), n * per_param)
            row["slice_ms_at_this_rate"] = row["median_ms"] * SLICE_PARAMS / n
            launches.append({"programs_per_sm": per_sm, "num_warps": warps, "block": block, "step": row})
    finally:
        adam_step.PROGRAMS_PER_SM, adam_step.NUM_WARPS, adam_step.BLOCK = shipped
    del opt, params
    torch.cuda.empty_cache()
    return out


def zero_buffer() -> dict[str, Any]:
    buf = torch.empty(SLICE_PARAMS, device="cuda", dtype=torch.float32)
    row = _rate(_time(lambda _: buf.zero_(), reps=5, warmup=2), SLICE_PARAMS * 4)
    del buf
    torch.cuda.empty_cache()
    return row


PASSES = {"swiglu": swiglu, "post_expert_norm": post_expert_norm, "adam": adam, "zero_grad_buffer": zero_buffer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", action="append", choices=list(PASSES), help="time only this pass (repeatable)")
    args = ap.parse_args(argv)
    from muse_stack.engines.megatron_available import require_megatron

    require_megatron()
    from muse_stack.engines.mcore import fuse

    fuse.configure(True)  # megatron-core's SwiGLU is compiled either way (its jit_fuser)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "method": "CUDA events around each call: 3 warm-up calls, then the median of 10 (Adam and the zeroing: "
                        "2 and 5); the kernels of one more call from torch.profiler",
              **{name: PASSES[name]() for name in (args.only or PASSES)}}
    import transformer_engine

    result["transformer_engine"] = transformer_engine.__version__
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
