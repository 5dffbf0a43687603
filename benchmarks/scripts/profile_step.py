"""Where one training step of the megatron engine spends its GPU time, by class of work.

The engine's own ``train_step`` runs ``--warmup`` steps, then ``--steps`` steps under the
PyTorch profiler (CPU and CUDA activities). The Chrome trace is parsed: every GPU kernel is
tied to the CPU thread and time of the runtime call that launched it (the trace's
``correlation`` id), and so to the operators open on that thread at that moment (forward ops
on the main thread, autograd nodes on the backward thread). Each kernel is put in the first
class whose rule matches its name or one of those operators:

  communication           NCCL kernels
  optimizer               the optimizer step (multi-tensor Adam, grad-norm and clipping kernels)
  grouped expert GEMM     GEMM kernels under TE's GroupedLinear (forward or backward)
  attention               fused / flash attention kernels, or anything under TE's attention
  router and permutation  routing (top-k, sigmoid scores), token permute / unpermute, sorts
  loss                    the vocab-parallel cross-entropy
  dense GEMM              every other GEMM kernel (cuBLAS / CUTLASS)
  norms and elementwise   the rest (norms, gates, residuals, softcap, activations, copies)

Each class also lists its largest launch sites: a kernel together with the innermost operators
open when it was launched (``--shapes`` adds the operators' input shapes), which names the code
behind the time.

Idle is the step's wall time with no kernel running (the union of kernel intervals subtracted
from the profiled steps' span). Times are per step, the mean over the profiled steps. The idle
time is also split by gap length, and the longest gaps are listed with what the host was doing
in them: the CUDA runtime call that overlaps the gap longest (a ``cudaStreamSynchronize`` or a
device-to-host copy is the host waiting on the GPU: a sync) and the operators open on that
call's thread, innermost last. A gap with no runtime call in it is the host busy in Python. Each
gap also names the blocking call that let the GPU run dry, if one returned as the gap began (a
``.cpu()`` or a data-dependent size waits for the GPU to finish, so the queue is empty when the
host goes on), and the idle time after such calls is summed.

    PYTHONPATH=. python benchmarks/scripts/profile_step.py slice-1gpu --warmup 5 --steps 2 --out profile.json \
        [--trace trace.json.gz]
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import finish, megatron_engine, recipe_args  # noqa: E402

CLASSES = ["communication", "optimizer", "grouped expert GEMM", "attention", "router and permutation", "loss",
           "dense GEMM", "norms and elementwise"]
SITE_DEPTH = 4  # operators named per launch site, innermost last
GAPS_LISTED = 12  # the longest idle gaps, with the host's activity in each
#: idle gaps split by length (microseconds): launch latency between kernels is a few microseconds;
#: a gap of a millisecond or more is the GPU starved by the host (a sync, or Python slower than the GPU)
GAP_BINS = ((0.0, 100.0), (100.0, 1000.0), (1000.0, float("inf")))
#: a gap counts as drained by a blocking call when a runtime call of at least BLOCKING_US returned
#: inside it, within DRAIN_SLACK_US of its start (launch calls take a few us; a blocking call
#: returns a few us after the GPU's last kernel ends)
BLOCKING_US, DRAIN_SLACK_US = 50.0, 50.0
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm100_|wgmma", re.I)


def classify(kernel: str, ops: list[str]) -> str:
    """The class of one kernel from its name and the names of the operators that launched it."""
    text = " ".join(ops)
    if "nccl" in kernel.lower():
        return "communication"
    if re.search(r"multi_tensor|adam", kernel, re.I) or re.search(r"Optimizer\.step|optimizer|clip_grad", text):
        return "optimizer"
    if GEMM.search(kernel) and re.search(r"GroupedLinear|grouped_gemm|GroupedMLP", text):
        return "grouped expert GEMM"
    if re.search(r"fmha|flash|attn|attention|sdpa", kernel, re.I) or \
            re.search(r"FusedAttn|DotProductAttention|fused_attn|scaled_dot_product", text):
        return "attention"
    if re.search(r"permute|topk|sort|radix|router", kernel, re.I) or \
            re.search(r"permute|router|topk|TopKRouter|routing", text, re.I):
        return "router and permutation"
    if re.search(r"cross_entropy|CrossEntropy", kernel + " " + text):
        return "loss"
    if GEMM.search(kernel):
        return "dense GEMM"
    return "norms and elementwise"


def summarise_trace(trace: dict, steps: int) -> dict:
    """Per-class GPU time per step, idle time and the top kernels of each class."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops_by_tid: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
    launches: dict[int, tuple[object, float]] = {}
    runtime: list[tuple[float, float, object, str]] = []  # every runtime / driver call: (start, end, tid, name)
    kernels = []
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") != "X":
            continue
        if cat == "cpu_op" or cat == "user_annotation" or cat == "python_function":
            dims = (e.get("args") or {}).get("Input Dims")  # with --shapes
            name = e["name"] + (str([d for d in dims if d]).replace(" ", "") if dims else "")
            ops_by_tid[e["tid"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), name))
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["tid"], e["name"]))
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (e["tid"], float(e["ts"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    starts = {tid: [o[0] for o in sorted(ops)] for tid, ops in ops_by_tid.items()}
    for tid in ops_by_tid:
        ops_by_tid[tid].sort()

    def ops_at(tid: object, ts: float) -> list[str]:
        ops = ops_by_tid.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        return [name for (a, b, name) in ops[max(0, i - 400):i] if a <= ts <= b]

    per_class = defaultdict(float)
    top: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    #: (kernel, innermost operators open at its launch) -> time: which code launched the time
    sites: dict[str, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
    intervals = []
    for k in kernels:
        dur = float(k.get("dur", 0))
        corr = (k.get("args") or {}).get("correlation")
        tid, ts = launches.get(corr, (None, None))
        ops = ops_at(tid, ts) if tid is not None else []
        cls = classify(k["name"], ops) if k.get("cat") == "kernel" else "norms and elementwise"
        per_class[cls] += dur
        top[cls][k["name"][:120]] += dur
        sites[cls][(k["name"][:80], " > ".join(ops[-SITE_DEPTH:]))] += dur
        intervals.append((float(k["ts"]), float(k["ts"]) + dur))
    intervals.sort()
    busy, span_start, span_end, cur_a, cur_b = 0.0, None, None, None, None
    gaps: list[tuple[float, float]] = []  # (start, end) of each stretch with no kernel running
    for a, b in intervals:
        span_start = a if span_start is None else min(span_start, a)
        span_end = b if span_end is None else max(span_end, b)
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
                gaps.append((cur_b, a))
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    span = (span_end - span_start) if span_start is not None else 0.0
    runtime.sort()
    runtime_starts = [r[0] for r in runtime]

    def host_in(a: float, b: float) -> dict:
        """The runtime call overlapping the gap (a, b) longest, and the operators open on its thread."""
        best, best_overlap = None, 0.0
        for r in runtime[max(0, bisect.bisect_left(runtime_starts, a) - 64):bisect.bisect_right(runtime_starts, b)]:
            overlap = min(r[1], b) - max(r[0], a)
            if overlap > best_overlap:
                best, best_overlap = r, overlap
        if best is None:
            return {"runtime_call": None, "runtime_call_share": 0.0, "operators": ""}
        return {"runtime_call": best[3], "runtime_call_share": best_overlap / (b - a),
                "operators": " > ".join(ops_at(best[2], max(best[0], a))[-SITE_DEPTH:])}

    runtime_ends = sorted((r[1], r) for r in runtime)
    end_keys = [e for e, _ in runtime_ends]

    def drained_by(a: float, b: float) -> dict | None:
        """The blocking call that let the GPU run dry: the longest runtime call (over BLOCKING_US)
        that returned inside the gap, within DRAIN_SLACK_US of its start (a blocking call returns
        once the GPU has finished what it waited for), with the operators open when it was called."""
        lo, hi = bisect.bisect_left(end_keys, a), bisect.bisect_right(end_keys, min(b, a + DRAIN_SLACK_US))
        calls = [r for _, r in runtime_ends[lo:hi] if r[1] - r[0] >= BLOCKING_US]
        if not calls:
            return None
        r = max(calls, key=lambda c: c[1] - c[0])
        return {"call": r[3], "seconds": (r[1] - r[0]) * 1e-6, "operators": " > ".join(ops_at(r[2], r[0])[-SITE_DEPTH:])}

    offset = span_start or 0.0
    by_length = [{"gap_us": f"{lo:g}-{hi:g}", "count_per_step": sum(lo <= b - a < hi for a, b in gaps) / steps,
                  "seconds_per_step": sum(b - a for a, b in gaps if lo <= b - a < hi) * 1e-6 / steps}
                 for lo, hi in GAP_BINS]
    longest = [{"at_s": (a - offset) * 1e-6, "seconds": (b - a) * 1e-6, **host_in(a, b), "drained_by": drained_by(a, b)}
               for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:GAPS_LISTED]]
    after_blocking = [(a, b) for a, b in gaps if b - a >= GAP_BINS[1][0] and drained_by(a, b) is not None]
    us = 1e-6 / steps
    total_kernel = sum(per_class.values())
    rows = [{"class": c, "seconds_per_step": per_class.get(c, 0.0) * us,
             "share_of_kernel_time": per_class.get(c, 0.0) / total_kernel if total_kernel else 0.0,
             "top_kernels": sorted(((n, t * us) for n, t in top[c].items()), key=lambda x: -x[1])[:5],
             "top_sites": [{"kernel": n, "operators": o, "seconds_per_step": t * us}
                           for (n, o), t in sorted(sites[c].items(), key=lambda x: -x[1])[:8]]}
            for c in CLASSES]
    return {"classes": rows, "kernel_seconds_per_step": total_kernel * us,
            "busy_seconds_per_step": busy * us, "span_seconds_per_step": span * us,
            "idle_seconds_per_step": (span - busy) * us, "idle_by_gap_length": by_length,
            "idle_after_blocking_calls": {"count_per_step": len(after_blocking) / steps,
                                          "seconds_per_step": sum(b - a for a, b in after_blocking) * us},
            "longest_gaps": longest,
            "kernels": len(kernels),
            "note": "kernel time can exceed busy time where kernels overlap on streams"}


def main(argv: list[str] | None = None) -> int:
    ap = recipe_args(steps=2, warmup=5)
    ap.add_argument("--trace", default=None, help="also keep the Chrome trace (gzip)")
    ap.add_argument("--shapes", action="store_true", help="record operator input shapes (named in the launch sites)")
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    total = args.warmup + args.steps
    _, engine, steps = megatron_engine(args.recipe, args.overrides, total)
    for step in range(1, args.warmup + 1):
        steps.step(step)
    torch.cuda.synchronize()
    import time

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.shapes) as prof:
        t0 = time.perf_counter()
        for step in range(args.warmup + 1, total + 1):
            steps.step(step)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if args.trace:
            with open(path, "rb") as src, gzip.open(args.trace, "wb") as dst:
                dst.write(src.read())
    result = {"recipe": args.recipe, "overrides": args.overrides, "device": torch.cuda.get_device_name(),
              "method": f"{args.warmup} warm-up steps, then {args.steps} steps under torch.profiler (CPU + CUDA"
                        + (", operator shapes recorded)" if args.shapes else ")"),
              "wall_seconds_per_step_profiled": wall, **summarise_trace(trace, args.steps)}
    for row in result["classes"]:
        print(f"{row['class']:<24} {row['seconds_per_step']:8.4f} s  {100 * row['share_of_kernel_time']:5.1f}%")
    for row in result["idle_by_gap_length"]:
        print(f"idle in gaps of {row['gap_us']:>10s} us: {row['count_per_step']:7.1f} per step, "
              f"{1e3 * row['seconds_per_step']:7.2f} ms per step")
    for g in result["longest_gaps"]:
        print(f"gap {1e3 * g['seconds']:7.3f} ms at {g['at_s']:.4f} s: {g['runtime_call']} "
              f"({100 * g['runtime_call_share']:.0f}%) | {g['operators'][-100:]}")
        if g["drained_by"]:
            d = g["drained_by"]
            print(f"    after {d['call']} ({1e3 * d['seconds']:.3f} ms) | {d['operators'][-100:]}")
    blocked = result["idle_after_blocking_calls"]
    print(f"idle after blocking calls: {blocked['count_per_step']:.1f} gaps per step, "
          f"{1e3 * blocked['seconds_per_step']:.2f} ms per step")
    finish(result, args.out, omit=lambda k: k in ("classes", "longest_gaps", "idle_by_gap_length",
                                                         "idle_after_blocking_calls"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
