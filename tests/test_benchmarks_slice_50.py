"""benchmarks/README.md's section on slice-1gpu at 50% restates the committed JSON: the SwiGLU and
optimizer levers, the shipped run and its first attempt, parity, the remeasured regressions, the
one-GPU checkpoint round trip and the profile; and the shipped recipe is the one that ran."""

from __future__ import annotations

import json
from pathlib import Path

from muse_stack.recipes.catalogue import load_recipe

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
README = (BENCH.parent / "README.md").read_text()
SECTION = README[README.index("## slice-1gpu at 50%"):README.index("## slice-1gpu at MBS 4")]


def _json(rel: str) -> dict:
    return json.loads((BENCH / rel).read_text())


def _rows() -> dict[str, list[str]]:
    start = SECTION.index("| step | file |")
    table = SECTION[start:SECTION.index("\n\n", start)]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    return {cells[1].strip("`"): cells for cells in rows}


def _sci(x: float) -> str:
    """3.07e-4, as the section writes it."""
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant}e{int(exp)}"


def _gain(a: str, b: str) -> str:
    return f"{100 * (_json(a)['tokens_per_s_per_gpu'] / _json(b)['tokens_per_s_per_gpu'] - 1):+.1f}%"


def test_every_row_restates_its_file():
    rows = _rows()
    assert len(rows) == 8
    for rel, cells in rows.items():
        r = _json(rel)
        assert cells[2] == f"{r['tokens_per_s_per_gpu']:,.0f}", rel
        assert cells[3] == f"{100 * r['mfu']:.2f}%", rel
        assert cells[4] == f"{r['step_time_mean_s']:.3f}", rel
        assert cells[5] == f"{r['peak_memory_gib']:.2f}", rel


def test_the_gains_are_the_ratios_of_the_rows():
    rows = _rows()
    base, swiglu = "levers/lever3-base.json", "levers/lever3-swiglu.json"
    assert rows[swiglu][6] == _gain(swiglu, base)
    for name in ("precision-aware", "mbs8"):
        rel = f"levers/lever3-{name}.json"
        assert rows[rel][6] == _gain(rel, swiglu) + " vs SwiGLU"
    fp32 = "levers/lever3-precision-aware-fp32.json"
    assert rows[fp32][6] == _gain(fp32, swiglu) + " vs SwiGLU (across machines)"
    shipped = "slice-1gpu-mbs4-precision-aware/results.json"
    assert rows[shipped][6] == _gain(shipped, base) + " (across machines)"


def test_what_each_row_ran():
    """Each engine_steps row records the SwiGLU and the Adam it ran, read off the engine's objects."""
    fused = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    base, swiglu = _json("levers/lever3-base.json"), _json("levers/lever3-swiglu.json")
    assert base["experts_swiglu"] == "weighted, given ones" and swiglu["experts_swiglu"] == "unweighted"
    for r in (base, swiglu):
        assert r["optimizer"] == [f"{fused} (megatron-core keeps the fp32 shards it updates)"]
    for name in ("precision-aware", "mbs8"):
        r = _json(f"levers/lever3-{name}.json")
        assert r["optimizer"] == [f"{fused} (holds the master weights: bf16 weight + int16 remainder)"]
    assert _json("levers/lever3-precision-aware-fp32.json")["optimizer"] == \
        [f"{fused} (holds the master weights: fp32)"]
    info = _json("slice-1gpu-mbs4-precision-aware/results.json")["engine_info"]
    assert info["optimizer"] == [f"{fused} (holds the master weights: fp32)"]
    assert info["experts_swiglu"] == "unweighted (megatron-core's fused SwiGLU)"
    # the SwiGLU is the same function: both rows start from the same step-1 loss (5 digits shown)
    assert round(base["steps"][0]["loss"], 5) == round(swiglu["steps"][0]["loss"], 5) == 10.44488
    assert "both rows start from the same step-1 loss (10.44488)" in SECTION


def test_the_remainders_save_memory_and_mbs8_needs_them():
    fp32, rem = _json("levers/lever3-swiglu.json"), _json("levers/lever3-precision-aware.json")
    saved = fp32["peak_memory_gib"] - rem["peak_memory_gib"]
    # 4,328,521,728 parameters x 2 bytes = 8.06 GiB, less the few fp32 gains that keep no remainder
    assert f"{saved:.2f} GiB less here" in SECTION and abs(saved - 4_328_521_728 * 2 / 2**30) < 0.01
    mem = _json("levers/lever3-mbs8.json")["device_memory"]
    assert f"{mem['device_used_gib']:.1f} of {mem['device_total_gib']:.1f} GiB in use" in SECTION


def test_the_shipped_recipe_is_the_one_that_ran_and_reaches_50_percent():
    ran = load_recipe(str(BENCH / "slice-1gpu-mbs4-precision-aware" / "recipe.yaml"))
    shipped = load_recipe("slice-1gpu")
    assert ran.model_config_resolved() == shipped.model_config_resolved()
    for part in ("layout", "batch", "recompute", "fusions", "optimizer", "numerics", "training", "data", "precision"):
        assert getattr(ran, part) == getattr(shipped, part), part
    assert (shipped.optimizer.precision_aware, shipped.optimizer.param_remainders) == (True, False)
    assert (shipped.batch.mbs, shipped.batch.gbs, shipped.batch.seq_length) == (4, 8, 4096)
    results = _json("slice-1gpu-mbs4-precision-aware/results.json")
    assert results["status"] == "completed" and results["mfu"] >= 0.50 and results["window"] == [11, 30]
    again = _json("det/slice-1gpu-default-a/results.json")
    assert again["mfu"] >= 0.50 and f"{100 * again['mfu']:.2f}%" in SECTION
    first = _json("slice-1gpu-mbs4-precision-aware/run1/results.json")
    assert first["mfu"] < 0.50 and f"{100 * first['mfu']:.2f}%" in SECTION
    steps = [json.loads(line) for line in (BENCH / "slice-1gpu-mbs4-precision-aware" / "run1" / "metrics.jsonl").read_text()
             .splitlines() if line.strip() and "step_time_s" in json.loads(line)]
    slow = max(steps[1:], key=lambda r: r["step_time_s"])
    assert slow["step"] == 29 and f"{slow['step_time_s']:.3f} s" in SECTION
    rest = [r["step_time_s"] for r in steps[1:] if r["step"] != 29]
    assert f"took {min(rest):.3f}-{max(rest):.3f} s" in SECTION


def test_parity_determinism_and_the_round_trip():
    compare = _json("slice-1gpu-mbs4-precision-aware/compare-vs-slice-1gpu-mbs4.json")
    assert compare["passed"] is True
    r = next(c["value"] for c in compare["convergence"]["checks"] if c["name"] == "correlation")
    assert f"r = {r:.10f}" in SECTION
    strict = _json("parity/parity-tp1-shipped.json")
    assert strict["max_step_loss_rel_diff"] < 2e-3 and strict["rel_diff_vs_fp32"] < 2e-3
    assert f"within {_sci(strict['max_step_loss_rel_diff'])}" in SECTION
    assert f"loss {_sci(strict['rel_diff_vs_fp32'])} from float32" in SECTION
    det = _json("det/slice-1gpu-det-compare.json")
    assert det["bitwise"]["identical"] is True and det["bitwise"]["steps"] == 20
    resume = _json("resume-1gpu-precision-aware/resume1-compare.json")
    assert resume["passed"] is True
    size = int((BENCH / "resume-1gpu-precision-aware" / "resume1-sizes.txt").read_text().split()[0])
    assert f"the {size / 1e9:.2f} GB\n    checkpoint holds the remainders" in SECTION
    assert load_recipe(str(BENCH / "resume-1gpu-precision-aware" / "resume1-part" / "recipe.yaml")).optimizer.param_remainders is True
    # the shipped setting: FusedAdam's fp32 master, 2 bytes per parameter more in the checkpoint
    fp32 = _json("resume-1gpu-precision-aware/fp32-master-compare.json")
    assert fp32["passed"] is True
    size32 = int((BENCH / "resume-1gpu-precision-aware" / "fp32-master-sizes.txt").read_text().split()[0])
    assert f"the checkpoint is\n    {size32 / 1e9:.2f} GB" in SECTION and size32 > size
    part = load_recipe(str(BENCH / "resume-1gpu-precision-aware" / "fp32-master-part" / "recipe.yaml")).optimizer
    assert (part.precision_aware, part.param_remainders) == (True, False)
    assert _json("resume-1gpu-precision-aware/fp32-master-part/results.json")["engine_info"]["optimizer"] == \
        ["transformer_engine.pytorch.optimizers.fused_adam.FusedAdam (holds the master weights: fp32)"]


def test_remeasured_regressions_are_stated():
    for name in ("proxy-1gpu", "packed-1gpu"):
        assert _json(f"remeasure/eager-restored/{name}-compare.json")["passed"] is True
        now, before = _json(f"remeasure/eager-restored/{name}/results.json"), _json(f"{name}/results.json")
        change = 100 * (now["tokens_per_s_per_gpu"] / before["tokens_per_s_per_gpu"] - 1)
        assert f"{change:+.1f}%" in SECTION, name
        assert f"{now['tokens_per_s_per_gpu']:,.0f} tokens/s against the committed " \
               f"{before['tokens_per_s_per_gpu']:,.0f}" in SECTION, name


def test_the_profile_is_stated():
    prof = _json("slice-1gpu-mbs1-compiled/profile-shipped.json")
    secs = {c["class"]: c["seconds_per_step"] for c in prof["classes"]}
    text = (BENCH / "slice-1gpu-mbs1-compiled" / "profile.md").read_text()
    for cls, s in secs.items():
        assert f"| {cls} | {s:.3f} |" in text, cls
    assert f"{prof['wall_seconds_per_step_profiled']:.3f} s per profiled step" in SECTION
    # multi_tensor_apply over 5 lists (gradient, bf16 weight, two moments, fp32 master) is FusedAdam's
    # update; over 2 (gradients in, out) the clipping scale; over 1 the gradient norm
    ms = {n: 1000 * sum(s["seconds_per_step"] for c in prof["classes"] if c["class"] == "optimizer"
                        for s in c["top_sites"] if f"TensorListMetadata<{n}," in s["kernel"]) for n in (5, 2, 1)}
    assert f"the Adam kernel {ms[5]:.1f} ms, the clipping scale over every gradient {ms[2]:.1f} ms,\n" \
           f"the gradient norm {ms[1]:.1f} ms" in SECTION
    assert f"grouped expert GEMMs {secs['grouped expert GEMM']:.3f} s" in SECTION


def test_readme_states_the_shipped_figure():
    results = _json("slice-1gpu-mbs4-precision-aware/results.json")
    readme = (BENCH.parents[1] / "README.md").read_text()
    # the README's figure: the median of the three runs of the recipe as shipped in gc-steady/, and FP8's
    runs = sorted(_json(f"gc-steady/manual{i}/results.json")["mfu"] for i in (1, 2, 3))
    worst = max(_json(f"gc-steady/manual{i}/results.json")["step_time_worst_ratio"] for i in (1, 2, 3))
    fp8 = _json("fp8-slice/fp8-alltoall/results.json")["mfu"]
    assert (f"`slice-1gpu` as shipped: median {100 * runs[1]:.2f}% MFU over three `muse-stack run`s on one H200, "
            f"every window step within {worst:.3f}x the median; {100 * fp8:.2f}% with the FP8 option") in readme
    ratio = results["tokens_per_s_per_gpu"] / _json("bridge/bridge-slice.json")["tokens_per_s_per_gpu"]
    assert f"the shipped run is {ratio:.3f}x, a ratio across leases" in SECTION
