"""Fit the planner's memory calibration to the measured H200 peaks (CPU only).

    python benchmarks/scripts/plan/fit.py [--json FILE] [--write]

Every benchmark of benchmarks/ that trained is one point: the recipe and overrides it ran with
(its run.sh), and the peak allocated memory of rank 0 (``peak_memory_gib`` in its
results.json; rank 0 holds pipeline stage 0). The planner splits its estimate into static
memory (bf16 weights, fp32 gradient buffers, Adam state), logits and activations; the fit is

    peak = static + logits + activation_factor x activations + runtime_overhead

by least squares over (activation_factor, runtime_overhead) on the eager runs, then over
compiled_activation_factor alone (runtime_overhead fixed) on the runs whose elementwise chains
were fused by torch.compile. Static memory is what the DDP buffers and the optimizer allocate
exactly, so it is not scaled. Prints each point's estimate with the fitted and with the current
defaults of ``Calibration``. ``--write`` writes the fit, rounded as ``ROUNDING`` says, into the planner's
calibration (``memory`` in ``muse_stack/plan/calibration.json``), each value with benchmarks/results/plan and
this command: the defaults of ``Calibration``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datafiles  # noqa: E402

from muse_stack.plan.memory import Calibration  # noqa: E402
from muse_stack.plan.planner import make_plan  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "results"
PACKED = ["data.kind=sft", "data.builder=packed", "data.files=[data/tiny-chat.jsonl]",
          "data.tokenizer=data/tiny-tokenizer", "data.loss_mask=muse_spark", "batch.packed=true",
          "batch.seq_length=1024"]
#: slice-1gpu as it was when its fitted runs were made (it now ships MBS 4 with the allgather dispatcher and
#: the precision-aware optimizer)
SLICE_AS_MEASURED = ["batch.mbs=1", "layout.dispatcher=alltoall", "optimizer.precision_aware=null", "optimizer.param_remainders=null"]
#: folder -> (recipe, overrides) as in the folder's run.sh
POINTS: dict[str, tuple[str, list[str]]] = {
    "proxy-1gpu": ("proxy-1gpu", []),
    "proxy-2gpu": ("proxy-2gpu", []),
    "slice-1gpu-mbs1-eager": ("slice-1gpu", [*SLICE_AS_MEASURED, "fusions.compile_elementwise=false"]),
    "slice-1gpu-mbs2-eager": ("slice-1gpu", [*SLICE_AS_MEASURED, "batch.mbs=2", "fusions.compile_elementwise=false"]),
    "tp2-recompute": ("proxy-2gpu", ["layout.ep=1", "layout.tp=2", "recompute.granularity=full"]),
    "pp2": ("proxy-2gpu", ["layout.ep=1", "layout.pp=2", "layout.pp_layers=[1,3]"]),
    "cp2": ("proxy-2gpu", ["layout.ep=1", "layout.cp=2", "layout.cp_comm_type=a2a"]),
    "etp2": ("proxy-2gpu", ["layout.ep=1", "layout.etp=2"]),
    "packed-1gpu": ("proxy-1gpu", PACKED),
    "packed-cp2": ("proxy-2gpu", [*PACKED, "layout.ep=1", "layout.cp=2", "layout.cp_comm_type=a2a"]),
    "recompute/full": ("proxy-1gpu", ["recompute.granularity=full"]),
    "recompute/core-attn": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[core_attn]"]),
    "recompute/moe-act": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[moe_act]"]),
    "recompute/moe": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[moe]"]),
}
#: the runs with fusions.compile_elementwise (fitted on their own: fused chains keep less)
COMPILED: dict[str, tuple[str, list[str]]] = {
    "slice-1gpu-mbs1-compiled": ("slice-1gpu", SLICE_AS_MEASURED),
    "slice-1gpu-mbs2-compiled": ("slice-1gpu", [*SLICE_AS_MEASURED, "batch.mbs=2"]),
    "proxy-2gpu-compiled": ("proxy-2gpu", ["fusions.compile_elementwise=true"]),
}


def parts(name: str, overrides: list[str]) -> tuple[float, float, float]:
    """(static, logits, activations) GiB of pipeline stage 0, uncalibrated."""
    recipe = load_recipe(name, overrides)
    plan, _ = make_plan(recipe, strict=False)
    stage = plan.memory[0]
    return (stage.weights_gib + stage.grads_gib + stage.optimizer_gib, stage.logits_gib or 0.0,
            stage.activations_gib or 0.0)


def measured(folder: str) -> float:
    return float(json.loads((BENCH / folder / "results.json").read_text())["peak_memory_gib"])


def estimate(p: tuple[float, float, float], cal: Calibration, compiled: bool) -> float:
    static, logits, act = p
    return static + logits + cal.activation_factor_for(compiled) * act + cal.runtime_overhead_gib


def fit() -> dict:
    eager = {n: parts(*POINTS[n]) for n in POINTS}
    fused = {n: parts(*COMPILED[n]) for n in COMPILED}
    for n, (name, overrides) in COMPILED.items():
        assert load_recipe(name, overrides).engine_options.compile_elementwise, n
    y = np.array([measured(n) - s - lg for n, (s, lg, _) in eager.items()])
    a = np.array([[act, 1.0] for _, _, act in eager.values()])
    (factor, overhead), *_ = np.linalg.lstsq(a, y, rcond=None)
    yc = np.array([measured(n) - s - lg - overhead for n, (s, lg, _) in fused.items()])
    ac = np.array([act for _, _, act in fused.values()])
    compiled_factor = float(ac @ yc / (ac @ ac))
    fitted = Calibration(activation_factor=float(factor), runtime_overhead_gib=float(overhead),
                         compiled_activation_factor=compiled_factor)
    current = Calibration()
    table = []
    for group, compiled in ((eager, False), (fused, True)):
        for n, p in group.items():
            m = measured(n)
            table.append({"benchmark": n, "compiled": compiled, "measured_gib": m, "static_gib": p[0],
                          "logits_gib": p[1], "activations_gib": p[2],
                          "estimate_fitted_gib": estimate(p, fitted, compiled),
                          "estimate_current_gib": estimate(p, current, compiled),
                          "error_current": estimate(p, current, compiled) / m - 1})
    return {"activation_factor": float(factor), "runtime_overhead_gib": float(overhead),
            "compiled_activation_factor": compiled_factor, "current": current.model_dump(), "points": table}


#: decimals each fitted value keeps in the calibration: the activation factors 0.01 (a rounding of at most
#: 0.005, 0.3% of them), the runtime buffers 0.1 GiB (at most 0.05 GiB)
ROUNDING = {"activation_factor": 2, "compiled_activation_factor": 2, "runtime_overhead_gib": 1}


def write_calibration(out: dict, json_out: Path | None, path: Path = datafiles.CALIBRATION) -> str:
    """Write the fit (``out``; ``json_out``: where its JSON went) into the planner's calibration (``memory``),
    each value rounded as ``ROUNDING`` says, with benchmarks/results/plan and this command."""
    cmd = datafiles.command(__file__, *(("--json", json_out) if json_out else ()), "--write")
    entries = {k: datafiles.entry(round(out[k], d), BENCH / "plan", cmd) for k, d in ROUNDING.items()}
    return datafiles.write_calibration({"memory": entries}, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write", action="store_true",
                    help="write the fit into the planner's calibration (muse_stack/plan/calibration.json)")
    args = ap.parse_args(argv)
    out = fit()
    cur = out["current"]
    print(f"fit: activation_factor {out['activation_factor']:.3f}, runtime_overhead_gib "
          f"{out['runtime_overhead_gib']:.2f}, compiled_activation_factor {out['compiled_activation_factor']:.3f} "
          f"(defaults: {cur['activation_factor']}, {cur['runtime_overhead_gib']}, {cur['compiled_activation_factor']})")
    print(f"{'benchmark':28} {'measured':>9} {'fit':>8} {'defaults':>9} {'error':>7}")
    for r in out["points"]:
        print(f"{r['benchmark'] + (' *' if r['compiled'] else ''):28} {r['measured_gib']:9.2f} "
              f"{r['estimate_fitted_gib']:8.2f} {r['estimate_current_gib']:9.2f} {r['error_current']:+7.1%}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.write:
        write_calibration(out, args.json)
        print(f"written to {datafiles.rel(datafiles.CALIBRATION)}")


if __name__ == "__main__":
    main()
