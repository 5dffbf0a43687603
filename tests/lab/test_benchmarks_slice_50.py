"""slice-1gpu at 50% (benchmarks/results/slice-1gpu-mbs4-precision-aware/): the figures benchmarks/index.yaml
states for it restate the committed JSON (the SwiGLU and optimizer levers, the shipped run and its first
attempt, parity, the remeasured regressions, the one-GPU checkpoint round trip and the profile), and the
shipped recipe is the one that ran."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from muse_stack.recipes.catalogue import load_recipe

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FIGURES = yaml.safe_load((BENCH.parent / "index.yaml").read_text())["figures"]
FIG = FIGURES["results/slice-1gpu-mbs4-precision-aware"]


def _json(rel: str) -> dict:
    return json.loads((BENCH / rel).read_text())


def _rows() -> dict[str, list[str]]:
    """The section's table: file under results/ -> tokens/s, MFU, step s, peak GiB, gain."""
    return {path.removeprefix("results/"): cells for path, cells in FIG["table"].items()}


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
        assert cells[0] == f"{r['tokens_per_s_per_gpu']:,.0f}", rel
        assert cells[1] == f"{100 * r['mfu']:.2f}%", rel
        assert cells[2] == f"{r['step_time_mean_s']:.3f}", rel
        assert cells[3] == f"{r['peak_memory_gib']:.2f}", rel


def test_the_gains_are_the_ratios_of_the_rows():
    rows = _rows()
    base, swiglu = "levers/lever3-base.json", "levers/lever3-swiglu.json"
    assert rows[swiglu][4] == _gain(swiglu, base)
    for name in ("precision-aware", "mbs8"):
        rel = f"levers/lever3-{name}.json"
        assert rows[rel][4] == _gain(rel, swiglu) + " vs SwiGLU"
    fp32 = "levers/lever3-precision-aware-fp32.json"
    assert rows[fp32][4] == _gain(fp32, swiglu) + " vs SwiGLU (across machines)"
    shipped = "slice-1gpu-mbs4-precision-aware/results.json"
    assert rows[shipped][4] == _gain(shipped, base) + " (across machines)"


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
    assert FIG["step1_loss"] == f"{round(base['steps'][0]['loss'], 5)}"


def test_the_remainders_save_memory_and_mbs8_needs_them():
    fp32, rem = _json("levers/lever3-swiglu.json"), _json("levers/lever3-precision-aware.json")
    saved = fp32["peak_memory_gib"] - rem["peak_memory_gib"]
    # 4,328,521,728 parameters x 2 bytes = 8.06 GiB, less the few fp32 gains that keep no remainder
    assert FIG["remainders_save_gib"] == f"{saved:.2f}" and abs(saved - 4_328_521_728 * 2 / 2**30) < 0.01
    mem = _json("levers/lever3-mbs8.json")["device_memory"]
    assert FIG["mbs8_memory_in_use_gib"] == [f"{mem['device_used_gib']:.1f}", f"{mem['device_total_gib']:.1f}"]


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
    assert again["mfu"] >= 0.50 and FIG["rerun_mfu"] == f"{100 * again['mfu']:.2f}%"
    first = _json("slice-1gpu-mbs4-precision-aware/run1/results.json")
    stated = FIG["first_attempt"]
    assert first["mfu"] < 0.50 and stated["mfu"] == f"{100 * first['mfu']:.2f}%"
    steps = [json.loads(line) for line in (BENCH / "slice-1gpu-mbs4-precision-aware" / "run1" / "metrics.jsonl")
             .read_text().splitlines() if line.strip() and "step_time_s" in json.loads(line)]
    slow = max(steps[1:], key=lambda r: r["step_time_s"])
    assert slow["step"] == stated["slow_step"] == 29 and stated["slow_step_s"] == f"{slow['step_time_s']:.3f}"
    rest = [r["step_time_s"] for r in steps[1:] if r["step"] != 29]
    assert stated["other_steps_s"] == f"{min(rest):.3f}-{max(rest):.3f}"


def test_parity_determinism_and_the_round_trip():
    compare = _json("slice-1gpu-mbs4-precision-aware/compare-vs-slice-1gpu-mbs4.json")
    assert compare["passed"] is True
    r = next(c["value"] for c in compare["convergence"]["checks"] if c["name"] == "correlation")
    assert FIG["loss_curve_r"] == f"{r:.10f}"
    strict = _json("parity/parity-tp1-shipped.json")
    assert strict["max_step_loss_rel_diff"] < 2e-3 and strict["rel_diff_vs_fp32"] < 2e-3
    assert FIG["parity"] == {"max_step_loss_rel_diff": _sci(strict["max_step_loss_rel_diff"]),
                             "loss_rel_diff_vs_fp32": _sci(strict["rel_diff_vs_fp32"])}
    det = _json("det/slice-1gpu-det-compare.json")
    assert det["bitwise"]["identical"] is True and det["bitwise"]["steps"] == 20
    resume = _json("resume-1gpu-precision-aware/resume1-compare.json")
    assert resume["passed"] is True
    size = int((BENCH / "resume-1gpu-precision-aware" / "resume1-sizes.txt").read_text().split()[0])
    assert FIG["checkpoint_gb"]["int16_remainders"] == f"{size / 1e9:.2f}"
    part = load_recipe(str(BENCH / "resume-1gpu-precision-aware" / "resume1-part" / "recipe.yaml"))
    assert part.optimizer.param_remainders is True
    # the shipped setting: FusedAdam's fp32 master, 2 bytes per parameter more in the checkpoint
    fp32 = _json("resume-1gpu-precision-aware/fp32-master-compare.json")
    assert fp32["passed"] is True
    size32 = int((BENCH / "resume-1gpu-precision-aware" / "fp32-master-sizes.txt").read_text().split()[0])
    assert FIG["checkpoint_gb"]["fp32_master"] == f"{size32 / 1e9:.2f}" and size32 > size
    part = load_recipe(str(BENCH / "resume-1gpu-precision-aware" / "fp32-master-part" / "recipe.yaml")).optimizer
    assert (part.precision_aware, part.param_remainders) == (True, False)
    assert _json("resume-1gpu-precision-aware/fp32-master-part/results.json")["engine_info"]["optimizer"] == \
        ["transformer_engine.pytorch.optimizers.fused_adam.FusedAdam (holds the master weights: fp32)"]
    # the same with the Triton Adam step, against its own uninterrupted run
    triton = _json("resume-1gpu-precision-aware/resumeadam-compare.json")
    assert triton["passed"] is True and triton["candidate"] == "runs/resumeadam-part"
    assert int((BENCH / "resume-1gpu-precision-aware" / "resumeadam-sizes.txt").read_text().split()[0]) > size
    for run in ("resumeadam-full", "resumeadam-part"):
        info = _json(f"resume-1gpu-precision-aware/{run}/results.json")["engine_info"]
        assert info["levers"]["adam_step"] == "one Triton launch per parameter group (adam_step.py)", run
        assert info["levers"]["embedding_grad"].startswith("each token's gradient added into"), run
    text = " ".join((BENCH / "slice-1gpu-mbs4-precision-aware" / "README.md").read_text().split())
    checks = {c["name"]: c["value"] for c in triton["convergence"]["checks"]}
    assert f"passed, r = {checks['correlation']:.7f}, final loss " \
           f"{checks['final loss']:.1e} apart".replace("e-04", "e-4") in text
    assert f"the checkpoint is {size32 / 1e9:.2f} GB, the fp32 master's size" in text


def test_remeasured_regressions_are_stated():
    assert set(FIG["remeasured"]) == {f"results/remeasure/eager-restored/{n}" for n in ("proxy-1gpu", "packed-1gpu")}
    for name in ("proxy-1gpu", "packed-1gpu"):
        stated = FIG["remeasured"][f"results/remeasure/eager-restored/{name}"]
        assert _json(f"remeasure/eager-restored/{name}-compare.json")["passed"] is True
        now, before = _json(f"remeasure/eager-restored/{name}/results.json"), _json(f"{name}/results.json")
        change = 100 * (now["tokens_per_s_per_gpu"] / before["tokens_per_s_per_gpu"] - 1)
        assert stated == {"tokens_per_s": f"{now['tokens_per_s_per_gpu']:,.0f}",
                          "committed_tokens_per_s": f"{before['tokens_per_s_per_gpu']:,.0f}",
                          "change": f"{change:+.1f}%"}, name


def test_the_profile_is_stated():
    prof = _json("slice-1gpu-mbs1-compiled/profile-shipped.json")
    secs = {c["class"]: c["seconds_per_step"] for c in prof["classes"]}
    text = (BENCH / "slice-1gpu-mbs1-compiled" / "profile.md").read_text()
    for cls, s in secs.items():
        assert f"| {cls} | {s:.3f} |" in text, cls
    # multi_tensor_apply over 5 lists (gradient, bf16 weight, two moments, fp32 master) is FusedAdam's
    # update; over 2 (gradients in, out) the clipping scale; over 1 the gradient norm
    ms = {n: 1000 * sum(s["seconds_per_step"] for c in prof["classes"] if c["class"] == "optimizer"
                        for s in c["top_sites"] if f"TensorListMetadata<{n}," in s["kernel"]) for n in (5, 2, 1)}
    assert FIG["profile"] == {"seconds_per_profiled_step": f"{prof['wall_seconds_per_step_profiled']:.3f}",
                              "grouped_expert_gemm_s": f"{secs['grouped expert GEMM']:.3f}",
                              "adam_ms": f"{ms[5]:.1f}", "clip_scale_ms": f"{ms[2]:.1f}", "grad_norm_ms": f"{ms[1]:.1f}"}


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
    assert FIG["vs_bridge"] == f"{ratio:.3f}"
