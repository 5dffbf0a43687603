"""The experts' SwiGLU backward by TE's kernel and the first micro-batch's gradient writes, attributed
(benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/): each run's settings read back from what the
engine recorded, and the verdicts recomputed from the committed result files (the README's figures are rendered from
them: test_benchmarks_rendered.py). CPU only; nothing is timed."""

from __future__ import annotations

import json
import statistics

from bench_results import Folder, script

FOLDER = Folder("te-swiglu-backward-and-first-microbatch-writes")
RUNS = ("shipped", "before", "mcore-swiglu", "whole-buffer", "shipped-again", "candidate-multi-kernel")
TE_BACKWARD = "unweighted (megatron-core's fused SwiGLU; the backward by Transformer Engine's dswiglu)"
MCORE = "unweighted (megatron-core's fused SwiGLU)"
levers_choose = script("levers_choose")
_json, _tps = FOLDER.json, FOLDER.tps
RESULTS = FOLDER.path.parent


def _median_step(run: str) -> float:
    return statistics.median(s["step_time_s"] for s in _json(f"{run}.json")["steps"][8:])


def test_each_run_ran_what_it_is_named_for():
    for run in RUNS:
        r = _json(f"{run}.json")
        te = run not in ("before", "mcore-swiglu")
        writes = run not in ("before", "whole-buffer")
        assert r["levers"]["experts_swiglu"] == (TE_BACKWARD if te else MCORE), run
        zeroing = r["levers"]["grad_buffer_zeroing"]
        if writes:
            assert zeroing.startswith("the step's first micro-batch writes the main gradients of 18 TE modules"), run
        else:
            assert zeroing == "the whole buffer, every step (performance.first_micro_batch_writes: false)", run
        assert ("performance.first_micro_batch_writes=false" in r["overrides"]) is not writes, run
    assert "7 passed" in (FOLDER.path / "gpu-test.txt").read_text()
    assert "3,791,650,816 of 4,329,152,512 elements" in _json("shipped.json")["levers"]["grad_buffer_zeroing"]


def test_the_attribution_is_levers_choose_rule_on_these_runs():
    base, drift = FOLDER.baseline_and_drift()
    threshold = max(2 * drift, levers_choose.MIN_GAIN)
    assert base / _tps("before") - 1 > threshold  # kept together
    swiglu = _tps("whole-buffer") / _tps("before") - 1  # the pair that differs only in the SwiGLU backward
    writes = base / _tps("whole-buffer") - 1
    candidate = base / _tps("candidate-multi-kernel") - 1
    assert swiglu > threshold  # kept on its own
    assert drift < writes < threshold  # above the drift, not above the rule's threshold
    assert abs(candidate) < threshold  # not kept
    # the stalled step: one window step far above its run's median; every other run steady
    steps = [s["step_time_s"] for s in _json("mcore-swiglu.json")["steps"]]
    assert max(steps[8:]) / _median_step("mcore-swiglu") > 1.4
    for run in RUNS:
        if run != "mcore-swiglu":
            r = _json(f"{run}.json")
            assert max(s["step_time_s"] for s in r["steps"][8:]) / _median_step(run) < 1.02, run
    worst = max(max(s["grad_norm"] for s in _json(f"{run}.json")["steps"][8:]) for run in RUNS)
    assert worst < 1.0  # every window step unclipped


def test_the_kernels_alone_rank_as_the_readme_reads_them():
    k = _json("kernels.json")
    sw = k["swiglu"]
    mc = sw["megatron-core bias_swiglu_impl (compiled)"]
    te = sw["transformer_engine ops.SwiGLU"]
    mine = sw["the engine's: megatron-core's forward, TE's dswiglu backward"]
    assert te["backward_ms"] < mc["backward_ms"] and mc["forward"]["median_ms"] < te["forward"]["median_ms"]
    assert mine["forward_and_backward"]["median_ms"] < mc["forward_and_backward"]["median_ms"]
    norm = k["post_expert_norm"]
    default = norm["inductor default"]["backward"]
    forced = norm["mix-order reduction forced (non-strict)"]["backward"]
    assert len(forced["kernels_ms"]) == len(default["kernels_ms"])  # not fused: the same kernels
    adam = k["adam"]
    first = adam[f"chunk {adam['default_chunk_size']}"]
    assert min(adam[f"chunk {c * adam['default_chunk_size']}"]["median_ms"] for c in (4, 16)) > first["median_ms"]


def test_the_profile_has_the_kernels_it_is_said_to():
    p = _json("profile-shipped.json")
    ew = next(c for c in p["classes"] if c["class"] == "norms and elementwise")
    sites = " ".join(s["kernel"] + s["operators"] for s in ew["top_sites"])
    assert "dgated_act_kernel" in sites and "aten::zero_" not in sites
    before = json.loads((RESULTS / "early-expert-counts-and-pre-mlp-norm" / "profile-shipped.json").read_text())
    old = next(c for c in before["classes"] if c["class"] == "norms and elementwise")
    assert "aten::zero_" in " ".join(s["kernel"] + s["operators"] for s in old["top_sites"])
