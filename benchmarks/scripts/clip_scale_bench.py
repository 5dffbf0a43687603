"""GPU time of the gradient clip's scale pass: TE's ``multi_tensor_scale_tensor`` (what
megatron-core calls) against ``muse_stack.engines.mcore.clip_scale.scale_unless_one``, at a
coefficient of 1 (an unclipped step) and below 1 (a clipped step), on one fp32 buffer cut into
views as megatron-core's gradient buffer is.

    python benchmarks/scripts/clip_scale_bench.py --elements 4328521728 --views 200 --out clip-scale.json

Each figure is the median of ``--reps`` calls, each timed with CUDA events after ``--warmup``
untimed calls. The results of the two kernels are also compared bitwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import cuda_median_seconds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=4_328_521_728,
                    help="fp32 gradients (default: slice-1gpu's gradient buffer, its profile's main_grad zero_)")
    ap.add_argument("--views", type=int, default=200)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import transformer_engine.pytorch  # noqa: F401 - loads TE's torch extension as transformer_engine_torch
    import transformer_engine_torch as tex

    from muse_stack.engines.mcore import clip_scale

    buffer = torch.randn(args.elements, device="cuda")
    cut = torch.linspace(0, args.elements, args.views + 1).long().tolist()
    grads = [buffer[a:b] for a, b in zip(cut, cut[1:]) if b > a]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")

    def te(c):
        tex.multi_tensor_scale_tensor(2048 * 32, flag, [grads, grads], c)

    def ours(c):
        clip_scale.scale_unless_one(2048 * 32, flag, [grads, grads], c)

    def time_ms(fn, c) -> float:
        return 1e3 * cuda_median_seconds(lambda: fn(c), args.reps, args.warmup)

    one = torch.ones(1, device="cuda")
    # a coefficient whose powers stay normal over every call above (0.5 ** 46 is still far from underflow)
    half = torch.full((1,), 0.5, device="cuda")
    rows = {
        "te_coeff_1_ms": time_ms(te, one), "ours_coeff_1_ms": time_ms(ours, one),
        "te_coeff_0.5_ms": time_ms(te, half), "ours_coeff_0.5_ms": time_ms(ours, half),
    }
    probe = torch.randn(10_000_019, device="cuda")
    a, b = [probe[:5_000_000], probe[5_000_000:]], [probe.clone()[:5_000_000], probe.clone()[5_000_000:]]
    for c in (one, half, torch.full((1,), 1 / 3, device="cuda")):
        tex.multi_tensor_scale_tensor(2048 * 32, flag, [a, a], c)
        clip_scale.scale_unless_one(2048 * 32, flag, [b, b], c)
    bitwise = all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "elements": args.elements, "views": len(grads), "spans": len(clip_scale.flat_spans(grads)),
        "method": f"median of {args.reps} calls after {args.warmup}, CUDA events", **rows,
        "bytes_moved_per_scaling_pass": 8 * args.elements,
        "ours_coeff_0.5_TBps": 8 * args.elements / rows["ours_coeff_0.5_ms"] / 1e9,
        "te_coeff_0.5_TBps": 8 * args.elements / rows["te_coeff_0.5_ms"] / 1e9,
        "bitwise_equal_to_te": bitwise,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if bitwise else 1


if __name__ == "__main__":
    sys.exit(main())
