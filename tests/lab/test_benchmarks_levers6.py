"""The clip scale that skips unclipped steps and the gated residual's compile fix, attributed
(benchmarks/results/levers6/): every figure its README states, recomputed from the committed result
files, and each run's settings read back from what the engine recorded. CPU only; nothing is timed."""

from __future__ import annotations

import json

from bench_results import Folder, script

FOLDER = Folder("levers6")
RUNS = ("shipped", "te-clip-scale", "shipped-again", "before", "shipped-third")
levers_choose = script("levers_choose")
_json, _tps, _text = FOLDER.json, FOLDER.tps, FOLDER.text
RESULTS = FOLDER.path.parent


def test_each_run_ran_the_clip_it_is_named_for():
    for run in RUNS:
        clip = _json(f"{run}.json")["levers"]["grad_clip"]
        if run == "te-clip-scale":
            assert "every step (TE's multi_tensor_scale_tensor)" in clip
        elif run == "before":  # the engine before the change names only TE's kernel
            assert clip == "norm and coefficient on the GPU (TE's multi_tensor_scale_tensor)"
        else:
            assert "none on an unclipped step" in clip, run
    # the window (steps 9-20) is unclipped in every run, so the skip applies to each of its steps
    for run in RUNS:
        steps = _json(f"{run}.json")["steps"]
        assert max(s["grad_norm"] for s in steps[8:]) < 1.0 and min(s["grad_norm"] for s in steps[:4]) > 1.0


def test_the_table_restates_the_runs():
    FOLDER.assert_run_table(RUNS)


def test_the_attribution_is_levers_choose_rule_on_these_runs():
    base, drift = FOLDER.baseline_and_drift()
    against = _tps("te-clip-scale") / base - 1
    skip = base / _tps("te-clip-scale") - 1
    both = _tps("shipped-third") / _tps("before") - 1
    threshold = max(2 * drift, levers_choose.MIN_GAIN)
    assert skip > threshold  # kept
    text = _text()
    assert f"mean of `shipped` and `shipped-again`, {base:,.0f} tokens/s; the two differ by {100 * drift:.2f}%" in text
    assert f"is {100 * against:+.2f}% against it, so the skip is worth {100 * skip:+.2f}%" in text
    assert f"twice the drift ({200 * drift:.2f}%)" in text
    assert f"**Both changes together: {100 * both:+.2f}%**" in text
    later = _tps("shipped-third") / _tps("shipped-again") - 1
    assert f"`shipped-third` ran {-100 * later:.2f}% below `shipped-again`" in text
    losses = [_json(f"{run}.json")["final_loss"] for run in RUNS]
    assert f"({max(losses) / min(losses) - 1:.1e})" in text
    docs = " ".join((RESULTS.parents[1] / "docs" / "gpu-engine.md").read_text().split())
    assert f"| {100 * skip:+.2f}% | yes: above twice the drift ({200 * drift:.2f}%)" in docs
    assert f"| {100 * both:+.2f}% with the clip change" in docs


def test_the_kernel_figures_are_its_measurement():
    k = _json("clip-scale.json")
    assert k["bitwise_equal_to_te"] is True and k["spans"] == 1 and k["views"] == 200
    text = _text()
    assert f"a {k['elements']:,}-element fp32 buffer" in text
    assert f"| 1 (an unclipped step) | {k['te_coeff_1_ms']:.2f} ms | {k['ours_coeff_1_ms']:.2f} ms |" in text
    assert (f"| 0.5 (a clipped step) | {k['te_coeff_0.5_ms']:.2f} ms ({k['te_coeff_0.5_TBps']:.2f} TB/s) | "
            f"{k['ours_coeff_0.5_ms']:.2f} ms ({k['ours_coeff_0.5_TBps']:.2f} TB/s) |") in text
    assert k["ours_coeff_1_ms"] < k["te_coeff_1_ms"] / 10
    assert "5 passed" in (FOLDER.path / "gpu-test.txt").read_text()


def test_the_profile_figures_are_the_profile():
    p = _json("profile-shipped.json")
    text = _text()
    bins = {b["gap_us"]: b for b in p["idle_by_gap_length"]}
    assert (f"{p['span_seconds_per_step']:.4f} s of span, {p['busy_seconds_per_step']:.4f} s busy, "
            f"{1e3 * p['idle_seconds_per_step']:.1f} ms idle "
            f"({100 * p['idle_seconds_per_step'] / p['span_seconds_per_step']:.1f}%)") in text
    for key, words in (("0-100", "gaps under 100 us"), ("100-1000", "gaps of 100 us to 1 ms"),
                       ("1000-inf", "gaps of 1 ms or more")):
        b = bins[key]
        assert f"{1e3 * b['seconds_per_step']:.2f} ms is in {b['count_per_step']:,g} {words}" in text, key
    classes = {c["class"]: c for c in p["classes"]}
    for name, c in classes.items():
        if c["seconds_per_step"] > 0:
            assert f"| {name} | {1e3 * c['seconds_per_step']:.1f} |" in text, name
    opt = dict(classes["optimizer"]["top_kernels"])
    assert not any("ScalePtrFunctor" in k for k in opt)  # no scale pass left in the step
    adam = next(v for k, v in opt.items() if "AdamFunctorMaster" in k)
    norm = next(v for k, v in opt.items() if "L2NormFunctor" in k)
    assert f"Adam {1e3 * adam:.2f} ms and the norm {1e3 * norm:.2f} ms" in text
    # the eager post-MLP residual's multiply is gone from the step
    assert "aten::mul[[8192],[4096,4,8192]]" not in (FOLDER.path / "profile-shipped.json").read_text()
    assert "aten::mul[[8192],[4096,4,8192]]" in (RESULTS / "side-by-side" / "2026-12-03" /
                                                 "profile-shipped.json").read_text()


def test_the_expert_gemm_table_is_its_measurement():
    folder = RESULTS / "expert-gemm"
    data = json.loads((folder / "expert-gemm.json").read_text())
    text = (folder / "README.md").read_text()
    for r in data["rows"]:
        cells = " | ".join(f"{1e3 * r[f'{k}_s']:.2f} ms, {r[f'{k}_tflops']:.0f} TFLOP/s" for k in ("te", "loop", "grouped_mm"))
        assert f"| {r['gemm']} | {r['split']} | {cells} |" in text
        assert r["flops"] == 3 * 2 * r["rows"] * r["in"] * r["out"]
        assert r["te_s"] == min(r["te_s"], r["loop_s"], r["grouped_mm_s"])  # "the fastest of the three"
    by = {(r["gemm"], r["split"]): r for r in data["rows"]}
    flat = " ".join(text.split())
    for split in ("even", "uneven"):  # 2 layers x 2 micro-batches a step
        step = 4 * 1e3 * (by[("fc1", split)]["te_s"] + by[("fc2", split)]["te_s"])
        assert f"{step:.1f} ms isolated with even splits" in flat if split == "even" else f"{step:.1f} ms uneven" in flat
    slower = [r["grouped_mm_s"] / r["te_s"] - 1 for r in data["rows"]]
    assert f"{100 * min(slower):.0f}-{100 * max(slower):.0f}% slower" in flat
    grouped = {c["class"]: c["seconds_per_step"] for c in _json("profile-shipped.json")["classes"]}["grouped expert GEMM"]
    assert f"{1e3 * grouped:.1f} ms of grouped-expert-GEMM kernel time" in flat
