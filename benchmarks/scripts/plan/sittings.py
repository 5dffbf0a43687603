"""The plan for slice-1gpu against each side-by-side sitting, priced with the kernels the sitting ran (CPU only).

    python benchmarks/scripts/plan/sittings.py [--json FILE] [SITTING ...]

A sitting is a folder of benchmarks/results/side-by-side/ with three ``muse-stack run slice-1gpu`` runs
(runner1..3/results.json). Each run records the engine's kernels in ``engine_info.levers``; the
three must agree. The plan is ``make_plan(slice-1gpu)`` with the planner's calibration as committed and
those kernels (``fit_time.kernels_of``), so a sitting of an older engine is predicted as that engine
ran; the sitting of the engine as shipped is the plan ``muse-stack plan slice-1gpu`` prints. The
measured figures are the runner's medians over the three runs: tokens/s per GPU and the median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit_time import BENCH, kernels_of  # noqa: E402

from muse_stack.util.errors import InputError, MuseStackError  # noqa: E402
from muse_stack.plan.cost import step_kernels  # noqa: E402
from muse_stack.plan.planner import make_plan  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe  # noqa: E402

SIDE_BY_SIDE = BENCH / "side-by-side"
#: the sittings the plan-sweep README states, oldest first
SITTINGS = ("2026-12-03-early-expert-counts-and-pre-mlp-norm", "2026-12-03-te-swiglu-backward-and-first-microbatch-writes",
            "2026-12-03-triton-adam", "2026-12-04")


def sitting(name: str) -> dict:
    """The plan against one sitting (see the module's text)."""
    folder = SIDE_BY_SIDE / name
    runs = []
    for i in (1, 2, 3):
        path = folder / f"runner{i}" / "results.json"
        if not path.is_file():
            raise InputError(f"{path} is missing", field="sitting", value=name,
                             fix="name a folder of side-by-side/ with runner1..3/results.json")
        runs.append(json.loads(path.read_text()))
    levers = [r.get("engine_info", {}).get("levers") for r in runs]
    if any(lv != levers[0] for lv in levers):
        raise InputError(f"{folder}: the three runs record different levers", field="engine_info.levers",
                         value=name, fix="a sitting runs one engine three times")
    recipe = load_recipe("slice-1gpu")
    kernels = kernels_of(recipe, levers[0])
    plan, _ = make_plan(recipe, strict=False, kernels=kernels)
    t = plan.time
    tps = statistics.median(r["tokens_per_s_per_gpu"] for r in runs)
    step = statistics.median(r["step_time_median_s"] for r in runs)
    return {"sitting": name, "kernels": kernels.model_dump(), "shipped_kernels": kernels == step_kernels(recipe),
            "measured_tokens_per_s_per_gpu": tps, "measured_median_step_s": step,
            "planned_tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "planned_step_s": t.step_s,
            "tokens_per_s_error": t.tokens_per_s_per_gpu / tps - 1, "step_error": t.step_s / step - 1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sittings", nargs="*", default=list(SITTINGS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        rows = [sitting(s) for s in args.sittings]
    except MuseStackError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"{'sitting':12} {'kernels (adam, embedding, norm backward)':44} {'measured':>9} {'plan':>9} "
          f"{'error':>6} {'step':>7} {'plan':>7} {'error':>6}")
    for r in rows:
        k = r["kernels"]
        kinds = f"{k['adam']}, {k['embedding_grad']}, {k['post_expert_norm_backward']}"
        print(f"{r['sitting']:12} {kinds:44} {r['measured_tokens_per_s_per_gpu']:9,.0f} "
              f"{r['planned_tokens_per_s_per_gpu']:9,.0f} {r['tokens_per_s_error']:+6.1%} "
              f"{r['measured_median_step_s']:7.4f} {r['planned_step_s']:7.4f} {r['step_error']:+6.1%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
