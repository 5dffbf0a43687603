"""Throughput of the experts' GEMMs at one micro-batch of ``slice-1gpu`` (16,384 tokens, top-8 of 32
experts: 131,072 routed rows, latent 4,096, expert FFN 4,096), three ways:

* ``te``: TE's ``GroupedLinear`` (what megatron-core's ``TEGroupedMLP`` runs), forward and backward,
  the weight gradient accumulated in fp32 into ``main_grad`` as the engine's fused accumulation does;
* ``loop``: one cuBLAS matmul per expert (``torch.matmul``), the same three GEMMs per expert, the
  weight gradient added into an fp32 ``main_grad``;
* ``grouped_mm``: PyTorch's grouped GEMM (``torch._grouped_mm``, one kernel per GEMM kind for all
  experts, the group offsets on the GPU), weight gradient in bf16 then added into fp32.

Each for fc1 (4,096 -> 8,192, gate and up) and fc2 (4,096 -> 4,096), with the routed rows split
evenly (4,096 per expert) and unevenly (Dirichlet(1) shares, each rounded to a multiple of 16,
which ``torch._grouped_mm`` requires). Each figure: the median of ``--reps`` calls after
``--warmup``, CUDA events around forward plus backward. FLOPs: 3 x 2 x rows x in x out.

    PYTHONPATH=/tmp/site:. python benchmarks/scripts/expert_gemm_bench.py --out expert-gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import cuda_median_seconds  # noqa: E402

ROWS, EXPERTS, LATENT = 131_072, 32, 4096
SHAPES = {"fc1": (LATENT, 2 * 4096), "fc2": (4096, LATENT)}


def splits(kind: str, seed: int = 0) -> list[int]:
    if kind == "even":
        return [ROWS // EXPERTS] * EXPERTS
    gen = torch.Generator().manual_seed(seed)
    share = -torch.log(torch.rand(EXPERTS, generator=gen))  # Dirichlet(1): normalised exponentials
    share = share / share.sum()
    counts = [int(round(float(s) * ROWS / 16)) * 16 for s in share]
    counts[counts.index(max(counts))] += ROWS - sum(counts)  # the total stays ROWS (a multiple of 16)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name, (k, n) in SHAPES.items():
        w = torch.randn(EXPERTS, n, k, device=dev, dtype=torch.bfloat16) * 0.02
        main_grad = torch.zeros(EXPERTS, n, k, device=dev, dtype=torch.float32)
        x = torch.randn(ROWS, k, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(ROWS, n, device=dev, dtype=torch.bfloat16)
        flops = 3 * 2 * ROWS * k * n
        for kind in ("even", "uneven"):
            m = splits(kind)

            def loop():
                xs, dys = x.split(m), dy.split(m)
                for e in range(EXPERTS):
                    y = xs[e] @ w[e].t()  # forward
                    dx = dys[e] @ w[e]  # data gradient
                    main_grad[e].add_(dys[e].t() @ xs[e])  # weight gradient, then into fp32
                return y, dx

            offs = torch.tensor(m, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)

            def grouped():
                y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)
                dx = torch._grouped_mm(dy, w, offs=offs, out_dtype=torch.bfloat16)
                dw = torch._grouped_mm(dy.t(), x, offs=offs, out_dtype=torch.bfloat16)
                main_grad.add_(dw)
                return y, dx

            result = {"gemm": name, "split": kind, "rows": ROWS, "experts": EXPERTS, "in": k, "out": n,
                      "min_rows": min(m), "max_rows": max(m), "flops": flops}
            for label, fn in (("loop", loop), ("grouped_mm", grouped)):
                try:
                    s = cuda_median_seconds(fn, args.reps, args.warmup)
                    result[f"{label}_s"], result[f"{label}_tflops"] = s, flops / s / 1e12
                except Exception as exc:  # noqa: BLE001 - recorded, the other methods still run
                    result[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                import transformer_engine.pytorch as te

                layer = te.GroupedLinear(EXPERTS, k, n, bias=False, params_dtype=torch.bfloat16,
                                         fuse_wgrad_accumulation=True, device="cuda")
                for i in range(EXPERTS):
                    p = getattr(layer, f"weight{i}")
                    p.main_grad = main_grad[i]
                xin = x.detach().requires_grad_(True)

                def te_step():
                    out = layer(xin, m)
                    out.backward(dy)

                s = cuda_median_seconds(te_step, args.reps, args.warmup)
                result["te_s"], result["te_tflops"] = s, flops / s / 1e12
            except Exception as exc:  # noqa: BLE001
                result["te_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(result), flush=True)
            rows.append(result)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "method": f"median of {args.reps} after {args.warmup}; CUDA events around forward + backward (3 GEMMs)",
           "peak_tflops": 989.0, "peak_source": "NVIDIA H100/H200 SXM datasheet, dense BF16", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
