"""Out-of-sample check of the step-time and used-memory model against the B200 record (CPU only).

    python benchmarks/scripts/plan/validate.py [--json FILE]

The model's constants come from the H200 fit (fit_time.py), the datasheets and the published link
bandwidths of the machine table (muse_stack/machine/machines.yaml: NVLink 5, EFA, InfiniBand, each
cited); nothing here feeds back into them. Predicts the record's tuned layout
(the attune-b200 recipe), its untuned starting point (TP 8, PP 8 with 7-layer first and last
stages, EP 16, DP 2, as the record's notes describe it), the used memory of the tuned run and
whether EP 4 fits; then runs `tune` on the record and times it on this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from muse_stack.machine.hardware import gpu_spec
from muse_stack.plan.cost import spec_links
from muse_stack.plan.fabrics import Links
from muse_stack.plan.planner import make_plan
from muse_stack.plan.tune import search
from muse_stack.recipes.catalogue import load_recipe

#: the record's notes: the untuned port of miles' H200 layout measured 343.3 tokens/s/GPU
UNTUNED = ["layout.tp=8", "layout.pp=8", "layout.first_stage_layers=7", "layout.last_stage_layers=7",
           "layout.ep=16", "layout.dp=2", "layout.label=null", "layout.summary=null", "layout.highlights=null"]
UNTUNED_MEASURED = 343.3
USED_MEASURED_GIB = 157.8  # the record's notes: peaked at 157.8 GiB used per GPU of 178.35


def predict(overrides: list[str], links: Links | None = None) -> dict:
    recipe = load_recipe("attune-b200", overrides)
    plan, _ = make_plan(recipe, strict=False, links=links)
    t = plan.time
    return {"overrides": overrides, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "step_s": t.step_s,
            "mfu": t.mfu, "dominant": t.dominant, "terms_s": t.terms_s, "allocated_gib": plan.peak_memory_gib,
            "used_gib": plan.used.used_gib, "fits": bool(plan.fits and plan.fits_used),
            # each communication term with the fabric and the cited figure it is priced at (machine/machines.yaml)
            "communication": [{"term": c.term, "seconds": c.seconds, "what": c.describe(),
                               "fabrics": [{"name": f.name, "gbps": f.gbps, "basis": f.bus.basis, "url": f.bus.url,
                                            "latency_us": f.latency.value if f.latency else None}
                                           for f in c.fabrics]} for c in t.communication],
            "communication_s": sum(c.seconds for c in t.communication)}


def _scaled(links: Links, part: str, gbps: float) -> Links:
    fabric = getattr(links, part)
    bus = fabric.bus.model_copy(update={"value": gbps, "basis": "derived",
                                        "note": "sensitivity: not a published figure"})
    return links.model_copy(update={part: fabric.model_copy(update={"bus": bus})})


def sensitivity(recipe, ratio_meas: float) -> list[dict]:
    """The ratio's error with slower links than the cited ones (what-if, not a fit): each row
    replaces one fabric's bus bandwidth in both layouts."""
    base = spec_links(gpu_spec(recipe.hardware.gpu), recipe.hardware.per_node)
    rows = []
    for part, gbps in (("inter", 25.0), ("inter", 10.0), ("intra", 370.0)):
        links = _scaled(base, part, gbps)
        a = predict([], links)["tokens_per_s_per_gpu"]
        b = predict(UNTUNED, links)["tokens_per_s_per_gpu"]
        rows.append({"fabric": getattr(base, part).name, "gbps": gbps, "tuned": a, "untuned": b,
                     "ratio_error": a / b / ratio_meas - 1})
    return rows


def validate() -> dict:
    recipe = load_recipe("attune-b200")
    measured = recipe.result.tokens_per_s_per_gpu
    tuned, untuned, ep4 = predict([]), predict(UNTUNED), predict(["layout.ep=4"])
    ratio_pred = tuned["tokens_per_s_per_gpu"] / untuned["tokens_per_s_per_gpu"]
    ratio_meas = measured / UNTUNED_MEASURED
    step_meas = recipe.batch.gbs * recipe.batch.seq_length / (measured * recipe.hardware.count)
    t0 = time.perf_counter()
    best, planned = search(recipe, top=5)
    elapsed = time.perf_counter() - t0
    return {
        "tuned": {**tuned, "measured": measured, "error": tuned["tokens_per_s_per_gpu"] / measured - 1},
        "untuned": {**untuned, "measured": UNTUNED_MEASURED,
                    "error": untuned["tokens_per_s_per_gpu"] / UNTUNED_MEASURED - 1},
        "ratio": {"predicted": ratio_pred, "measured": ratio_meas, "error": ratio_pred / ratio_meas - 1},
        # the tuned step's measured time (GBS x sequence / (tokens/s/GPU x GPUs)) and what the model lacks of it
        "tuned_step": {"measured_s": step_meas, "predicted_s": tuned["step_s"],
                       "missing_s": step_meas - tuned["step_s"], "communication_s": tuned["communication_s"]},
        "link_sensitivity": sensitivity(recipe, ratio_meas),
        "used": {"predicted_gib": tuned["used_gib"], "measured_gib": USED_MEASURED_GIB,
                 "error": tuned["used_gib"] / USED_MEASURED_GIB - 1},
        "ep4": {"allocated_gib": ep4["allocated_gib"], "used_gib": ep4["used_gib"], "fits": ep4["fits"]},
        "tune": {"planned": planned, "seconds": elapsed, "cpu": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count(),
                 "best": [c.model_dump() for c in best],
                 "gain_over_own_prediction": best[0].tokens_per_s_per_gpu / tuned["tokens_per_s_per_gpu"] - 1,
                 "gain_over_measured": best[0].tokens_per_s_per_gpu / measured - 1},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = validate()
    for k in ("tuned", "untuned"):
        r = out[k]
        print(f"{k:8} predicted {r['tokens_per_s_per_gpu']:7.1f} tokens/s/GPU, measured {r['measured']:7.2f} "
              f"({r['error']:+.1%}); dominant {r['dominant']}")
        for c in r["communication"]:
            print(f"         communication: {c['term']} {c['seconds']:.3f} s: {c['what']}")
    r = out["ratio"]
    print(f"ratio    predicted {r['predicted']:.2f}, measured {r['measured']:.2f} ({r['error']:+.1%})")
    st = out["tuned_step"]
    print(f"tuned step measured {st['measured_s']:.2f} s, predicted {st['predicted_s']:.2f} s "
          f"(communication {st['communication_s']:.2f} s); {st['missing_s']:.2f} s in no term")
    for row in out["link_sensitivity"]:
        print(f"if {row['fabric']} ran at {row['gbps']:g} GB/s: ratio error {row['ratio_error']:+.1%}")
    u = out["used"]
    print(f"used     predicted {u['predicted_gib']:.1f} GiB, measured {u['measured_gib']} GiB ({u['error']:+.1%})")
    print(f"EP 4     allocated {out['ep4']['allocated_gib']:.1f} GiB, used {out['ep4']['used_gib']:.1f} GiB, "
          f"fits: {out['ep4']['fits']}")
    t = out["tune"]
    print(f"tune     {t['planned']} layouts in {t['seconds']:.1f} s; best {t['best'][0]['label']} "
          f"{t['best'][0]['tokens_per_s_per_gpu']:.1f} tokens/s/GPU ({t['gain_over_own_prediction']:+.1%} over the "
          f"model's figure for the record's layout)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
