"""GPU time of the vision tower's forward and backward, its blocks as written against their chained forward in
plain PyTorch and compiled (``engine_options.compile_towers``: muse_stack/engines/mcore/towers.py), each with its
activations in fp32 (as shipped) and in bf16 (``engine_options.towers_bf16_activations``: the ``bf16-`` modes), and
with its attention in one variable-length call a layer (``engine_options.towers_varlen_attention``: the ``varlen-``
modes, written, with bf16 activations, and with all three candidates together).

    python benchmarks/scripts/towers_step.py --out towers-step.json

The tower is the released one (``VisionConfig()``: 50 blocks of width 1536, MLP 8960), bf16 weights on one GPU,
its blocks recomputed in the backward as ``slice-1gpu-mm`` runs them (``--no-recompute``: kept). The patches are
one micro-batch of images of ``--grid`` (t,h,w in patches; the default's three receipts of about 60 x 70 patches
make about 3,100 merged tokens, the slice's 3,072 a row). Needs torch only (no Transformer Engine).

Each mode's time is the median of ``--reps`` forward-and-backward passes, each bracketed by CUDA events (so the
GPU's idle time between kernels counts), after ``--warmup`` untimed ones (the compiled mode compiles in them).
``--device cpu`` with a small ``--config`` checks the script itself (tests/lab/test_towers_step.py).
One more pass under torch.profiler counts its GPU kernels and sums their time by class (GEMM, attention, and the
memory-bound rest: norms, casts, RoPE, GELU, residual adds, gathers and scatters, by profile_step.py's classifier).
The bytes that rest reads and writes in one pass are counted by running the same pass under the planner's traffic
recorder (muse_stack/models/muse_spark/traffic.py, which prices the towers' memory traffic; not in the compiled modes,
whose chains run kernels of their own rather than aten ops), so their ratio is the
bandwidth the towers' memory-bound kernels reach (``memory_bound_gbps``), to set against the datasheet HBM figure
the planner prices them at (muse_stack/machine/machines.yaml). Each chained mode's output is checked equal to the
written blocks' output (of the same activations) bit for bit, and each compiled mode's largest relative difference
from it is reported; so is the bf16 tower's from the fp32 one's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/scripts/: profile_step's classifier

from lab.benchio import cuda_median_seconds  # noqa: E402
from profile_step import classify  # noqa: E402

#: the blocks' chains, by mode; a ``bf16-`` mode runs the same with bf16 activations, a ``varlen-`` one with the
#: variable-length attention
CHAINS = ("written", "chained", "compiled")
MODES = CHAINS + tuple(f"bf16-{c}" for c in CHAINS) + ("varlen-written", "varlen-bf16-written",
                                                      "varlen-bf16-compiled")


def grid(text: str) -> torch.Tensor:
    return torch.tensor([[int(v) for v in item.split(",")] for item in text.split(";")])


#: profile_step.py's classes of a kernel, as this script sums them
KERNEL_CLASSES = {"dense GEMM": "gemm", "attention": "attention"}


def profile_pass(fn) -> dict:
    """One pass of ``fn`` under torch.profiler: its GPU kernels and their time (ms) by class (:data:`KERNEL_CLASSES`,
    the rest ``memory_bound``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ms = dict.fromkeys(("gemm", "attention", "memory_bound"), 0.0)
    for e in kernels:
        ms[KERNEL_CLASSES.get(classify(e.name, []), "memory_bound")] += e.time_range.elapsed_us() / 1e3
    return {"kernels": len(kernels), "kernel_ms": ms}


def counted_bytes(fn) -> int:
    """The bytes one pass of ``fn`` moves outside its GEMMs and attention, as the planner counts them."""
    from muse_stack.models.muse_spark.traffic import TrafficRecorder

    with TrafficRecorder() as recorder:
        fn()
    return recorder.bytes


def median_seconds(fn, reps: int, warmup: int, device: str) -> float:
    """CUDA events around each call on a GPU; the wall clock on a CPU (a check of the script, not a figure)."""
    if device == "cuda":
        return cuda_median_seconds(fn, reps, warmup)
    import statistics
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", type=grid, default=grid("1,60,72;1,56,72;1,60,68"),
                    help="images as t,h,w patches, separated by ';'")
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the script's own check with a small tower (--config), timed by the wall clock")
    ap.add_argument("--config", default="{}", type=json.loads,
                    help='VisionConfig fields that differ from the released tower, as JSON (e.g. \'{"num_hidden_layers": 2}\')')
    args = ap.parse_args(argv)

    from muse_stack.engines.mcore import towers
    from muse_stack.models.muse_spark.tower_config import VisionConfig
    from muse_stack.models.muse_spark.vision import EAGER_CHAINS, MuseSparkVisionModel

    torch.manual_seed(0)
    cfg = VisionConfig(**args.config)
    model = MuseSparkVisionModel(cfg).to(device=args.device, dtype=torch.bfloat16)
    model.recompute = not args.no_recompute
    patches = int(args.grid.prod(dim=1).sum())
    pixels = torch.randn(patches, cfg.patch_dim, device=args.device)
    gthw = args.grid.to(args.device)
    chains = {"written": None, "chained": EAGER_CHAINS, "compiled": towers.compiled_chains()}
    outputs, rows = {}, {}
    for mode in args.modes:
        words = mode.split("-")
        towers.set_chains(model, chains[words[-1]])
        towers.install_towers_bf16_activations(model, "bf16" in words)
        why = towers.install_towers_varlen_attention(model, "varlen" in words)
        if why:
            print(f"{mode:>20}: skipped, {why}", flush=True)
            continue

        def step():
            model.zero_grad(set_to_none=True)
            out = model(pixels, gthw)
            out.float().square().mean().backward()
            return out

        outputs[mode] = step().detach()
        seconds = median_seconds(step, args.reps, args.warmup, args.device)
        profiled = profile_pass(step) if args.device == "cuda" else {"kernels": None, "kernel_ms": None}
        # a compiled chain runs kernels of its own, not aten ops: the recorder cannot count them
        moved = None if mode.endswith("compiled") else counted_bytes(step)
        memory_ms = profiled["kernel_ms"]["memory_bound"] if profiled["kernel_ms"] else None
        rows[mode] = {"fwd_bwd_ms": seconds * 1e3, "kernels_per_pass": profiled["kernels"],
                      "kernel_ms": profiled["kernel_ms"], "counted_bytes": moved,
                      "memory_bound_gbps": moved / memory_ms / 1e6 if memory_ms and moved else None}
        print(f"{mode:>20}: {seconds * 1e3:9.2f} ms forward and backward, {rows[mode]['kernels_per_pass']} kernels",
              flush=True)
    checks = {}

    def max_rel_diff(a: str, b: str) -> float:
        ref = outputs[a].float()
        return float(((outputs[b].float() - ref).abs().max() / ref.abs().max()).item())

    for act in ("", "bf16-"):
        written = f"{act}written"
        if written in outputs and f"{act}chained" in outputs:
            checks[f"{act}chained_equals_written"] = bool(torch.equal(outputs[written], outputs[f"{act}chained"]))
        if written in outputs and f"{act}compiled" in outputs:
            checks[f"{act}compiled_max_rel_diff"] = max_rel_diff(written, f"{act}compiled")
    if "written" in outputs and "bf16-written" in outputs:
        checks["bf16_written_max_rel_diff"] = max_rel_diff("written", "bf16-written")
    for mode in outputs:
        if mode.startswith("varlen-") and mode.removeprefix("varlen-") in outputs:
            checks[f"{mode}_max_rel_diff"] = max_rel_diff(mode.removeprefix("varlen-"), mode)
    record = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "config": {"blocks": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                         "intermediate": cfg.intermediate_size, "heads": cfg.num_attention_heads},
              "grid": args.grid.tolist(), "patches": patches, "recompute": model.recompute,
              "method": f"median of {args.reps} forward+backward passes after {args.warmup} warm-up passes, CUDA "
                        "events around each; kernels counted and their time summed by class over one more pass "
                        "under torch.profiler; the memory-bound kernels' bytes counted by the planner's traffic "
                        "recorder over one more pass",
              "modes": rows, "checks": checks}
    print(json.dumps(checks))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
