"""The clip scale that skips unclipped steps and the gated residual's compile fix, attributed
(benchmarks/results/clip-skip-and-gated-residual/): each run's settings read back from what the engine recorded, and
the verdict by levers_choose.py's rule recomputed from the committed result files. The README's, docs' and
expert-gemm README's figures are rendered from the same files (test_benchmarks_rendered.py). CPU only; nothing is
timed."""

from __future__ import annotations

import json

import pytest
from bench_results import Folder, script

FOLDER = Folder("clip-skip-and-gated-residual")
RUNS = ("shipped", "te-clip-scale", "shipped-again", "before", "shipped-third")
levers_choose = script("levers_choose")
_json, _tps = FOLDER.json, FOLDER.tps
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


def test_the_attribution_is_levers_choose_rule_on_these_runs():
    base, drift = FOLDER.baseline_and_drift()
    skip = base / _tps("te-clip-scale") - 1
    both = _tps("shipped-third") / _tps("before") - 1
    threshold = max(2 * drift, levers_choose.MIN_GAIN)
    assert skip > threshold  # kept
    assert both > skip  # "+1.32% with the clip change": the compile fix's own share
    assert both - skip < 2 * drift  # ... is within the drift
    assert _tps("shipped-third") < _tps("shipped-again")  # "later runs were slower"


def test_the_kernel_skips_the_pass_and_matches_te_bit_for_bit():
    k = _json("clip-scale.json")
    assert k["bitwise_equal_to_te"] is True and k["spans"] == 1 and k["views"] == 200
    assert k["ours_coeff_1_ms"] < k["te_coeff_1_ms"] / 10
    assert "5 passed" in (FOLDER.path / "gpu-test.txt").read_text()


def test_the_profile_has_no_scale_pass_and_no_eager_residual():
    p = _json("profile-shipped.json")
    bins = {b["gap_us"]: b for b in p["idle_by_gap_length"]}
    assert sum(b["seconds_per_step"] for b in bins.values()) == pytest.approx(p["idle_seconds_per_step"], rel=1e-9)
    classes = {c["class"]: c for c in p["classes"]}
    opt = dict(classes["optimizer"]["top_kernels"])
    assert not any("ScalePtrFunctor" in k for k in opt)  # no scale pass left in the step
    assert any("AdamFunctorMaster" in k for k in opt) and any("L2NormFunctor" in k for k in opt)
    # the eager post-MLP residual's multiply is gone from the step
    assert "aten::mul[[8192],[4096,4,8192]]" not in (FOLDER.path / "profile-shipped.json").read_text()
    assert "aten::mul[[8192],[4096,4,8192]]" in (RESULTS / "side-by-side" / "2026-12-03" /
                                                 "profile-shipped.json").read_text()


def test_the_expert_gemm_measurement_is_consistent():
    data = json.loads((RESULTS / "expert-gemm" / "expert-gemm.json").read_text())
    for r in data["rows"]:
        assert r["flops"] == 3 * 2 * r["rows"] * r["in"] * r["out"]
        assert r["te_s"] == min(r["te_s"], r["loop_s"], r["grouped_mm_s"])  # "the fastest of the three"
