"""Fit the step-time model's kernel efficiencies to the measured H200 step times (CPU only).

    python benchmarks/scripts/plan/fit_time.py [--json FILE]

Each fitted point is a megatron-core run of benchmarks/ that measured 30 steps (10 warm-up):
the recipe and overrides it ran with (benchmarks/scripts/plan/fit.py's POINTS and COMPILED, the same
runs the memory calibration uses, less those that measured fewer than 20 steps) and its
``step_time_mean_s``. The model (muse_stack/plan/cost.py) is linear in six unknowns,

    1 / dense GEMM efficiency, 1 / expert GEMM efficiency, 1 / attention efficiency,
    elementwise HBM passes (eager), elementwise HBM passes (compiled), seconds per layer pass,

plus terms that need no fitting (collectives at datasheet bandwidth, the optimizer step), so
each unknown's coefficient is read off the model with that unknown set to 1 and the others to
0, and the unknowns are fitted by least squares on the relative error, all of them held
non-negative (every subset of free unknowns is solved; the best non-negative one is kept).

Runs not fitted are checked: the short runs (6 steps, one or two measured: recompute settings,
TP 2 with recompute, the resume runs) and the replays of the B200 stack on H200. The expected
error on an unseen single-GPU variant is the leave-one-out error over the fitted single-GPU
runs: each is predicted by a fit to all the other fitted runs.

Nothing here reads the B200 record.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit import COMPILED, POINTS, SLICE_AS_MEASURED  # noqa: E402

from muse_stack.plan.cost import TimeCalibration  # noqa: E402
from muse_stack.plan.planner import make_plan  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "results"
#: unknown -> the TimeCalibration fields it sets. Dense GEMMs, expert GEMMs and attention share one
#: efficiency: fitted apart they are not identified by these runs (the fit sends two of them to
#: infinity and moves their time into the others), so only the roofline tells their shapes apart.
UNKNOWNS: dict[str, list[str]] = {
    "matmul_efficiency": ["gemm_efficiency_dense", "gemm_efficiency_expert", "attention_efficiency"],
    "elementwise_passes": ["elementwise_passes"],
    "elementwise_passes_compiled": ["elementwise_passes_compiled"],
    "layer_overhead_s": ["layer_overhead_s"],
    "microbatch_overhead_s": ["microbatch_overhead_s"],
    "expert_overhead_s": ["expert_overhead_s"],
}
INVERSE = {"matmul_efficiency"}
#: a value that makes an efficiency's term vanish (its inverse is ~0) without dividing by zero
HUGE = 1e30

#: runs that measured fewer than 20 steps or replay another stack: checked, not fitted
CHECKS: dict[str, tuple[str, list[str]]] = {
    "recompute/none": ("proxy-1gpu", []),
    "recompute/full": ("proxy-1gpu", ["recompute.granularity=full"]),
    "recompute/core-attn": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[core_attn]"]),
    "recompute/moe-act": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[moe_act]"]),
    "recompute/moe": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[moe]"]),
    "tp2-recompute": ("proxy-2gpu", ["layout.ep=1", "layout.tp=2", "recompute.granularity=full"]),
    "resume/ep2-full": ("proxy-2gpu", []),
    "resume/pp2-full": ("proxy-2gpu", ["layout.ep=1", "layout.pp=2", "layout.pp_layers=[1,3]"]),
    "replay-h200": ("slice-1gpu", SLICE_AS_MEASURED),
    "replay-b200": ("slice-1gpu", SLICE_AS_MEASURED),
    # adapters on a frozen base (lora-64's peft block on the slice, `h200.sh peftrun`; 20 steps, 10 measured)
    "peft-lora-slice/full": ("slice-1gpu", [
        *SLICE_AS_MEASURED, "peft.scheme=lora", "peft.rank=32", "peft.alpha=32", "peft.dropout=0.0", "peft.per_expert=true",
        "peft.targets=[self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,mlp.experts.gate_up_proj,"
        "mlp.experts.down_proj,mlp.pre_expert_proj,mlp.post_expert_proj]", "frozen=[base]"]),
}


def runs() -> dict[str, tuple[str, list[str]]]:
    fitted = {**POINTS, **COMPILED}
    return {n: v for n, v in fitted.items() if n not in CHECKS}


def results(folder: str) -> dict:
    return json.loads((BENCH / folder / "results.json").read_text())


def step_time(name: str, overrides: list[str], cal: TimeCalibration) -> float:
    plan, _ = make_plan(load_recipe(name, overrides), strict=False, time_calibration=cal)
    assert plan.time is not None, (name, overrides, plan.time_unavailable)
    return plan.time.step_s


def calibration(values: dict[str, float]) -> TimeCalibration:
    """``values``: each unknown as the model is linear in it (efficiencies inverted)."""
    fields = {}
    for k, v in values.items():
        for f in UNKNOWNS[k]:
            fields[f] = (1 / v if v > 0 else HUGE) if k in INVERSE else v
    return TimeCalibration(**fields)


def design(points: dict[str, tuple[str, list[str]]]) -> tuple[np.ndarray, np.ndarray]:
    """(coefficients [run, unknown], the time that needs no unknown [run])."""
    zero = {u: 0.0 for u in UNKNOWNS}
    base = np.array([step_time(*points[n], calibration(zero)) for n in points])
    cols = []
    for u in UNKNOWNS:
        one = {**zero, u: 1.0}
        cols.append(np.array([step_time(*points[n], calibration(one)) for n in points]) - base)
    return np.stack(cols, axis=1), base


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every unknown >= 0, by solving each subset of free unknowns."""
    best, best_res = np.zeros(a.shape[1]), float(y @ y)
    for r in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
            if (x < 0).any():
                continue
            res = float(((a[:, free] @ x - y) ** 2).sum())
            if res < best_res:
                best_res, best = res, np.zeros(a.shape[1])
                best[list(free)] = x
    return best


def solve(a: np.ndarray, base: np.ndarray, measured: np.ndarray) -> np.ndarray:
    # relative error: divide each run's equation by its measured time
    return nnls(a / measured[:, None], (measured - base) / measured)


def to_values(x: np.ndarray) -> dict[str, float]:
    return {u: (1 / v if v > 0 else float("inf")) if u in INVERSE else float(v) for u, v in zip(UNKNOWNS, x)}


def check_defaults(values: dict[str, float]) -> list[str]:
    """Fields of TimeCalibration() that differ from the fit by more than its printed rounding."""
    cur = TimeCalibration()
    return [f for u, v in values.items() for f in UNKNOWNS[u] if abs(getattr(cur, f) - v) > 5e-4 * max(1.0, abs(v))]


def fit() -> dict:
    points = runs()
    names = list(points)
    a, base = design(points)
    measured = np.array([results(n)["step_time_mean_s"] for n in names])
    x = solve(a, base, measured)
    values = to_values(x)
    cal = calibration({u: float(v) for u, v in zip(UNKNOWNS, x)})
    # leave one out over the single-GPU runs
    loo = {}
    for j, n in enumerate(names):
        if results(n)["world_size"] != 1:
            continue
        keep = np.arange(len(names)) != j
        xj = solve(a[keep], base[keep], measured[keep])
        loo[n] = float((a[j] @ xj + base[j]) / measured[j] - 1)
    table = []
    for j, n in enumerate(names):
        pred = float(a[j] @ x + base[j])
        table.append({"benchmark": n, "set": "fitted", "gpus": results(n)["world_size"], "measured_s": float(measured[j]),
                      "predicted_s": pred, "error": pred / measured[j] - 1, "leave_one_out_error": loo.get(n)})
    for n, (name, ov) in CHECKS.items():
        r = results(n)
        pred = step_time(name, ov, cal)
        table.append({"benchmark": n, "set": "checked", "gpus": r["world_size"], "measured_s": r["step_time_mean_s"],
                      "predicted_s": pred, "error": pred / r["step_time_mean_s"] - 1, "leave_one_out_error": None})
    loo_abs = [abs(v) for v in loo.values()]
    return {"fitted": values, "inverse_fitted": dict(zip(UNKNOWNS, map(float, x))),
            "leave_one_out_single_gpu_mean_abs_error": float(np.mean(loo_abs)) if loo_abs else None,
            "leave_one_out_single_gpu_max_abs_error": float(np.max(loo_abs)) if loo_abs else None,
            "current": TimeCalibration().model_dump(), "defaults_differ": check_defaults(values), "points": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = fit()
    print("fit: " + ", ".join(f"{k} {v:.4g}" for k, v in out["fitted"].items()))
    print(f"leave-one-out error on single-GPU runs: mean {out['leave_one_out_single_gpu_mean_abs_error']:.1%}, "
          f"max {out['leave_one_out_single_gpu_max_abs_error']:.1%}")
    print(f"{'benchmark':24} {'set':8} {'GPUs':>4} {'measured s':>10} {'model s':>8} {'error':>7} {'LOO':>7}")
    for r in out["points"]:
        loo = f"{r['leave_one_out_error']:+7.1%}" if r["leave_one_out_error"] is not None else ""
        print(f"{r['benchmark']:24} {r['set']:8} {r['gpus']:4} {r['measured_s']:10.3f} {r['predicted_s']:8.3f} "
              f"{r['error']:+7.1%} {loo:>7}")
    if out["defaults_differ"]:
        print(f"TimeCalibration defaults differ from this fit: {', '.join(out['defaults_differ'])}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
