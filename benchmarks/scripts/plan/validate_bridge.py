"""The planner's step time at scale checked on Megatron-Bridge's published MoE runs (CPU only).

    python benchmarks/scripts/plan/validate_bridge.py --fit [--write]    # fit rows only
    python benchmarks/scripts/plan/validate_bridge.py [--json FILE]      # every row, tune, the record

The rows, the models' shapes, each run's settings and the protocol are muse_stack/plan/published/bridge-moe.yaml;
every row is priced as it ran (``Published.run``: the page's columns with the settings Bridge's source gives).
``--fit`` reads the protocol's fit rows and nothing else: it fits the two constants the protocol names (the Blackwell kernel
efficiency and the GPU's idle time per MoE layer's token-count sync) by least squares on the log of tokens/s/GPU,
over a grid (efficiency 0.30 to 0.70 by 0.005, host time 0 to 10 ms by 0.1 ms), and ``--write`` writes them into
muse_stack/plan/calibration.json (``scale``). Without ``--fit`` it predicts every row with the calibration as it
stands: the error, the role, the page's layout and the run's with the settings that differ and their sources,
the per-generation summary (validation rows only), where each run's layout ranks among the layouts ``tune`` finds
for its GPU count, and the B200 record's two layouts with the model's
step split into named terms (nothing here is fitted to the record).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from muse_stack.plan.cost import TimeCalibration
from muse_stack.plan.published import load
from muse_stack.plan.scale import ScaleCalibration, estimate, tune

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
import datafiles  # noqa: E402

RESULT = HERE.parents[3] / "benchmarks" / "results" / "bridge-moe-validation"
#: the layout fields each row's entry records (the run's, and the page's)
LAYOUT = ("gpus", "gbs", "mbs", "seq", "tp", "pp", "cp", "vp", "ep", "etp")
EFFICIENCIES = [round(0.30 + 0.005 * i, 4) for i in range(81)]
GAPS = [round(1e-4 * i, 6) for i in range(101)]


def fit() -> dict:
    published = load()
    rows = [r for r in published.rows if published.role(r.id) == "fit"]
    hopper = TimeCalibration()
    best = None
    for e in EFFICIENCIES:
        for g in GAPS:
            cal = ScaleCalibration(gemm_efficiency_sm100=e, moe_sync_gap_s=g)
            loss = sum(math.log(estimate(published, published.run(r.id), cal=cal, hopper=hopper).tokens_per_s_per_gpu
                                / r.published_tokens_per_s_per_gpu) ** 2 for r in rows)
            if best is None or loss < best[0]:
                best = (loss, e, g)
    loss, e, g = best
    cal = ScaleCalibration(gemm_efficiency_sm100=e, moe_sync_gap_s=g)
    errors = {r.id: estimate(published, published.run(r.id), cal=cal, hopper=hopper).tokens_per_s_per_gpu
              / r.published_tokens_per_s_per_gpu - 1 for r in rows}
    return {"fit_rows": [r.id for r in rows], "gemm_efficiency_sm100": e, "moe_sync_gap_s": g,
            "rms_log_error": math.sqrt(loss / len(rows)), "fit_errors": errors}


def predict_all(with_tune: bool = True) -> dict:
    published = load()
    cal, hopper = ScaleCalibration(), TimeCalibration()
    rows = []
    for r in published.rows:
        run = published.run(r.id)
        step = estimate(published, run, cal=cal, hopper=hopper)
        err = step.tokens_per_s_per_gpu / r.published_tokens_per_s_per_gpu - 1
        entry = {"id": r.id, "role": published.role(r.id), "model": r.model, "system": r.system, "gpu": step.gpu,
                 "precision": r.precision, "layout": {k: getattr(run, k) for k in LAYOUT},
                 "page_layout": {k: getattr(r, k) for k in LAYOUT} | {"ga": r.ga},
                 "page_differs": published.corrections(r.id),
                 "run_settings": {k: getattr(run, k) for k in ("mtp", "recompute", "overlap_param_gather",
                                                               "cross_entropy", "dispatcher", "cuda_graphs",
                                                               "a2a_overlap")},
                 "microbatches": run.microbatches,
                 "published_tokens_per_s_per_gpu": r.published_tokens_per_s_per_gpu,
                 "predicted_tokens_per_s_per_gpu": step.tokens_per_s_per_gpu, "error": err,
                 "predicted_mfu": step.mfu, "step_s": step.step_s, "terms_s": step.terms_s,
                 "dominant": max(step.terms_s, key=lambda k: step.terms_s[k]),
                 "memory_gib": step.memory_gib, "memory_parts_gib": step.memory_parts_gib,
                 "capacity_gib": step.capacity_gib, "fits": step.fits,
                 "chunk_layers": step.chunk_layers}
        if with_tune and entry["role"] == "validation":
            found = tune(published, run, cal=cal, hopper=hopper)
            rank = next(i for i, c in enumerate(found) if c.published) + 1
            top = found[0]
            mine = found[rank - 1]
            entry["tune"] = {
                "layouts": len(found), "published_rank": rank,
                "best": top.model_dump() | {"label": top.label()},
                "published": mine.model_dump() | {"label": mine.label()},
                "best_over_published": top.tokens_per_s_per_gpu / mine.tokens_per_s_per_gpu - 1,
                "why": why(published, run, top, cal, hopper) if rank > 1 else "the run's layout is the pick"}
        rows.append(entry)
    val = [x for x in rows if x["role"] == "validation"]
    summary = {}
    for gen in sorted({x["gpu"] for x in rows}):
        sel = [abs(x["error"]) for x in val if x["gpu"] == gen]
        if sel:
            summary[gen] = {"rows": len(sel), "median_abs_error": statistics.median(sel), "max_abs_error": max(sel)}
    goal = published.protocol.goal
    abs_val = [abs(x["error"]) for x in val]
    overall = {"rows": len(val), "median_abs_error": statistics.median(abs_val), "max_abs_error": max(abs_val),
               "within_max": sum(a <= goal.max_abs_error for a in abs_val),
               "fit_rows": len(rows) - len(val),
               "all_fit_in_memory": all(x["fits"] for x in rows),
               "goal_median": goal.median_abs_error, "goal_max": goal.max_abs_error,
               "meets_goal": statistics.median(abs_val) <= goal.median_abs_error
               and max(abs_val) <= goal.max_abs_error}
    return {"source": published.source.model_dump(), "protocol": published.protocol.model_dump(),
            "calibration": {"scale": cal.model_dump(), "hopper_gemm_efficiency": hopper.gemm_efficiency_dense},
            "rows": rows, "by_generation": summary, "validation": overall}


def why(published, row, top, cal, hopper) -> str:
    """The terms where tune's pick and the run's layout differ most, per step."""
    mine = estimate(published, row, cal=cal, hopper=hopper)
    pick = estimate(published, row.model_copy(update={"tp": top.tp, "pp": top.pp, "vp": top.vp, "ep": top.ep,
                                                       "mbs": top.mbs}), cal=cal, hopper=hopper)
    keys = set(mine.terms_s) | set(pick.terms_s)
    diffs = sorted(((mine.terms_s.get(k, 0.0) - pick.terms_s.get(k, 0.0), k) for k in keys), reverse=True)
    parts = [f"{k} {d:+.3f} s" for d, k in diffs[:3] if d >= 5e-4] or ["no term by more than 0.5 ms"]
    return (f"{top.label()} saves {mine.step_s - pick.step_s:.3f} s of {mine.step_s:.3f} s per step: "
            + ", ".join(parts) + f" (the run's layout's terms minus the pick's); its memory {pick.memory_gib:.0f} "
            f"of {pick.capacity_gib:.0f} GiB")


#: forward passes of a decoder layer per micro-batch under full recompute (the forward and its recomputation), and
#: the forward-equivalents of a micro-batch's work (forward, backward twice the forward, recomputed forward)
RECOMPUTE_FORWARDS, FULL_RECOMPUTE_WORK = 2, 4


def record() -> dict:
    """The B200 record's two layouts, from validate.py's predictions (the Muse Spark model, nothing fitted to the
    record), the step split into named terms, the gap to the measured step, and the at-scale host term priced on
    each layout as for a published run without CUDA graphs (the record's command line graphs nothing and runs
    megatron-core 0.19's alltoall dispatcher in bf16): the measured host time of a MoE layer with the layout's local
    experts (ScaleCalibration.ungraphed_host_s; nothing fitted) against the layer's GPU work, the forward twice a
    layer and micro-batch (forward and recompute), the backward once, a layer's GPU forward being the slowest
    stage's GPU work per micro-batch over its layers and the 4 forward-equivalents of a fully recomputed
    micro-batch, its backward 2 of them."""
    sys.path.insert(0, str(HERE.parent))
    import validate  # noqa: E402  (benchmarks/scripts/plan/validate.py)
    from muse_stack.plan.planner import make_plan
    from muse_stack.recipes.catalogue import load_recipe

    recipe = load_recipe("attune-b200")
    cal = ScaleCalibration()
    out = {}
    for name, overrides, measured in (("tuned", [], recipe.result.tokens_per_s_per_gpu),
                                      ("untuned", validate.UNTUNED, validate.UNTUNED_MEASURED)):
        p = validate.predict(overrides)
        layout = load_recipe("attune-b200", overrides)
        plan, _ = make_plan(layout, strict=False)
        t = plan.time
        slow = max(range(len(t.stage_s)), key=lambda j: t.stage_s[j])
        layers = plan.stages[slow]
        fwd_layer = t.stage_gpu_s[slow] / layers / FULL_RECOMPUTE_WORK
        bwd_layer = (FULL_RECOMPUTE_WORK - RECOMPUTE_FORWARDS) * fwd_layer
        experts = plan.experts_per_ep_rank
        host_fwd, host_bwd = cal.ungraphed_host_s(layout.precision == "fp8", experts)
        sync = t.microbatches * layers * (RECOMPUTE_FORWARDS * max(0.0, host_fwd - fwd_layer)
                                          + max(0.0, host_bwd - bwd_layer))
        step_meas = recipe.batch.gbs * recipe.batch.seq_length / (measured * recipe.hardware.count)
        out[name] = {"overrides": overrides, "measured_tokens_per_s_per_gpu": measured,
                     "predicted_tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"],
                     "error": p["tokens_per_s_per_gpu"] / measured - 1, "measured_step_s": step_meas,
                     "predicted_step_s": p["step_s"], "terms_s": p["terms_s"],
                     "host_sync_at_scale": {"moe_layer_forward_gpu_s": fwd_layer,
                                            "moe_layer_backward_gpu_s": bwd_layer, "local_experts": experts,
                                            "host_fwd_s": host_fwd, "host_bwd_s": host_bwd, "added_s": sync},
                     "gap_s": step_meas - p["step_s"] - sync}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="fit the protocol's constants to the fit rows only")
    ap.add_argument("--write", action="store_true", help="with --fit: write them into calibration.json")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--no-tune", action="store_true")
    args = ap.parse_args()
    if args.fit:
        out = fit()
        print(json.dumps(out, indent=1))
        if args.write:
            cmd = datafiles.command(HERE, "--fit", "--write")
            datafiles.write_calibration({"scale": {
                "gemm_efficiency_sm100": datafiles.entry(out["gemm_efficiency_sm100"], RESULT, cmd),
                "moe_sync_gap_s": datafiles.entry(out["moe_sync_gap_s"], RESULT, cmd)}})
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
        return
    out = predict_all(with_tune=not args.no_tune)
    out["record"] = record()
    for x in out["rows"]:
        t = x.get("tune", {})
        print(f"{x['id']:30} {x['role']:10} published {x['published_tokens_per_s_per_gpu']:7.0f} predicted "
              f"{x['predicted_tokens_per_s_per_gpu']:7.0f} ({x['error']:+.1%}) {x['dominant']:12} "
              f"mem {x['memory_gib']:5.0f}/{x['capacity_gib']:.0f}"
              + (f"  rank {t['published_rank']}/{t['layouts']}" if t else ""))
    print(json.dumps(out["by_generation"], indent=1), json.dumps(out["validation"], indent=1))
    for k, v in out["record"].items():
        print(f"record {k}: measured {v['measured_tokens_per_s_per_gpu']:.1f}, predicted "
              f"{v['predicted_tokens_per_s_per_gpu']:.1f} ({v['error']:+.1%}); step {v['measured_step_s']:.2f} s "
              f"measured, {v['predicted_step_s']:.2f} s predicted, {v['gap_s']:.2f} s in no term")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
