"""The experts' counts read early and the pre-MLP norm in the residual's chain, attributed
(benchmarks/results/early-expert-counts-and-pre-mlp-norm/): each run's settings read back from what the engine
recorded, and the verdict recomputed from the committed result files (the README's figures are rendered from them:
test_benchmarks_rendered.py). CPU only; nothing is timed."""

from __future__ import annotations

import json

from bench_results import Folder, script

FOLDER = Folder("early-expert-counts-and-pre-mlp-norm")
RUNS = ("shipped", "before", "late-counts", "separate-pre-mlp-norm", "shipped-again")
EARLY = "before the latent GEMM, copied without blocking; the weights permuted with the tokens"
FUSED = "in the post-attention residual's chain"
levers_choose = script("levers_choose")
_json, _tps = FOLDER.json, FOLDER.tps
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


def test_the_attribution_is_levers_choose_rule_on_these_runs():
    base, drift = FOLDER.baseline_and_drift()
    threshold = max(2 * drift, levers_choose.MIN_GAIN)
    assert base / _tps("before") - 1 > threshold  # kept together
    counts = base / _tps("late-counts") - 1
    norm = base / _tps("separate-pre-mlp-norm") - 1
    assert counts < threshold and norm < threshold  # neither alone passes
    worst = max(max(s["grad_norm"] for s in _json(f"{run}.json")["steps"][8:]) for run in RUNS)
    assert worst < 1.0  # every window step unclipped


def test_what_the_profile_shows():
    """The README's reading of the profile (its figures are rendered from it): the only blocking call that drained
    the GPU is a two-element copy, and no gap at the grouped GEMM follows a blocking call."""
    p = _json("profile-shipped.json")
    before = json.loads((RESULTS / "clip-skip-and-gated-residual" / "profile-shipped.json").read_text())
    assert p["idle_seconds_per_step"] < before["idle_seconds_per_step"]
    drains = [g["drained_by"] for g in p["longest_gaps"] if g["drained_by"]]
    assert drains and all(d["operators"].startswith("aten::to[[2]]") for d in drains)
    assert all(g["drained_by"] is None for g in p["longest_gaps"] if "_GroupedLinear" in g["operators"])
