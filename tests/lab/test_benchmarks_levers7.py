"""The experts' counts read early and the pre-MLP norm in the residual's chain, attributed
(benchmarks/results/levers7/): every figure its README states, recomputed from the committed result
files, and each run's settings read back from what the engine recorded. CPU only; nothing is timed."""

from __future__ import annotations

import json

from bench_results import Folder, script

FOLDER = Folder("levers7")
RUNS = ("shipped", "before", "late-counts", "separate-pre-mlp-norm", "shipped-again")
EARLY = "before the latent GEMM, copied without blocking; the weights permuted with the tokens"
FUSED = "in the post-attention residual's chain"
levers_choose = script("levers_choose")
_json, _tps, _text = FOLDER.json, FOLDER.tps, FOLDER.text
RESULTS = FOLDER.path.parent


def test_each_run_ran_what_it_is_named_for():
    for run in RUNS:
        levers = _json(f"{run}.json")["levers"]
        early = run not in ("before", "late-counts")
        fused = run not in ("before", "separate-pre-mlp-norm")
        assert (levers["expert_counts"] == EARLY) is early, run
        assert levers["expert_counts"] in (EARLY, "megatron-core's AllGatherDispatcher"), run
        assert (levers["pre_mlp_norm"] == FUSED) is fused, run
        assert levers["pre_mlp_norm"] in (FUSED, "its own chain"), run
    assert "5 passed" in (FOLDER.path / "gpu-test.txt").read_text()


def test_the_table_restates_the_runs():
    FOLDER.assert_run_table(RUNS)


def test_the_attribution_is_levers_choose_rule_on_these_runs():
    base, drift, threshold = FOLDER.assert_both_kept(levers_choose.MIN_GAIN, RUNS)  # kept together
    counts = base / _tps("late-counts") - 1
    norm = base / _tps("separate-pre-mlp-norm") - 1
    assert counts < threshold and norm < threshold  # neither alone passes
    text = _text()
    assert f"the early counts are worth {100 * counts:+.2f}%" in text
    assert f"the norm in the residual's chain {100 * norm:+.2f}%" in text


def test_the_profile_figures_are_the_profile():
    p = _json("profile-shipped.json")
    before = json.loads((RESULTS / "levers6" / "profile-shipped.json").read_text())
    text = _text()
    idle = lambda q: f"{1e3 * q['idle_seconds_per_step']:.1f} ms idle ({100 * q['idle_seconds_per_step'] / q['span_seconds_per_step']:.1f}%)"  # noqa: E731
    assert (f"{p['span_seconds_per_step']:.4f} s of span, {p['busy_seconds_per_step']:.4f} s busy, {idle(p)}, "
            f"against {idle(before).replace(' idle', '')}") in text
    bins = {b["gap_us"]: b for b in p["idle_by_gap_length"]}
    for key, words in (("0-100", "gaps under 100 us"), ("100-1000", "gaps of 100 us to 1 ms"),
                       ("1000-inf", "gaps of 1 ms or more")):
        b = bins[key]
        assert f"{1e3 * b['seconds_per_step']:.2f} ms is in {b['count_per_step']:,g} {words}" in text, key
    old = {b["gap_us"]: b for b in before["idle_by_gap_length"]}["1000-inf"]
    assert f"(levers6: {1e3 * old['seconds_per_step']:.2f} ms in {old['count_per_step']:g})" in text
    blocked = p["idle_after_blocking_calls"]
    assert f"{blocked['count_per_step']:g} a step, {1e3 * blocked['seconds_per_step']:.2f} ms a step" in text
    drains = [g["drained_by"] for g in p["longest_gaps"] if g["drained_by"]]
    assert drains and all(d["operators"].startswith("aten::to[[2]]") for d in drains)
    # the README's "waited about X s" is each recorded wait (a committed file, not a timing) to two decimals
    assert {f"the host waited about {d['seconds']:.2f} s" for d in drains} == {"the host waited about 0.19 s"}
    assert "the host waited about 0.19 s" in text
    gl = [g["seconds"] for g in p["longest_gaps"] if "_GroupedLinear" in g["operators"] and g["seconds"] > 5e-4]
    assert f"now {1e3 * min(g for g in gl if g > 8e-4):.1f}-{1e3 * max(gl):.1f} ms" in text
    assert all(g["drained_by"] is None for g in p["longest_gaps"] if "_GroupedLinear" in g["operators"])
    classes = {c["class"]: c for c in p["classes"]}
    for name, c in classes.items():
        if c["seconds_per_step"] > 0:
            assert f"| {name} | {1e3 * c['seconds_per_step']:.1f} |" in text, name
    assert f"({p['busy_seconds_per_step']:.4f} s) is now {100 * p['busy_seconds_per_step'] / p['span_seconds_per_step']:.1f}%" in text
