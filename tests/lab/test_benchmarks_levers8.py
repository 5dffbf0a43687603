"""The experts' SwiGLU backward by TE's kernel and the first micro-batch's gradient writes, attributed
(benchmarks/results/levers8/): every figure its README states, recomputed from the committed result
files, and each run's settings read back from what the engine recorded. CPU only; nothing is timed."""

from __future__ import annotations

import json
import statistics

from bench_results import Folder, script

FOLDER = Folder("levers8")
RUNS = ("shipped", "before", "mcore-swiglu", "whole-buffer", "shipped-again", "candidate-multi-kernel")
TE_BACKWARD = "unweighted (megatron-core's fused SwiGLU; the backward by Transformer Engine's dswiglu)"
MCORE = "unweighted (megatron-core's fused SwiGLU)"
levers_choose = script("levers_choose")
_json, _tps, _text = FOLDER.json, FOLDER.tps, FOLDER.text
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
    text = _text()
    assert "(3,791,650,816 of 4,329,152,512 buffer elements)" in text
    assert "3,791,650,816 of 4,329,152,512 elements" in _json("shipped.json")["levers"]["grad_buffer_zeroing"]


def test_the_table_restates_the_runs():
    FOLDER.assert_run_table(RUNS)


def test_the_attribution_is_levers_choose_rule_on_these_runs():
    base, drift, threshold = FOLDER.assert_both_kept(levers_choose.MIN_GAIN, RUNS)  # kept together
    swiglu = _tps("whole-buffer") / _tps("before") - 1  # the pair that differs only in the SwiGLU backward
    writes = base / _tps("whole-buffer") - 1
    candidate = base / _tps("candidate-multi-kernel") - 1
    assert swiglu > threshold  # kept on its own
    assert drift < writes < threshold  # above the drift, not above the rule's threshold
    assert abs(candidate) < threshold  # not kept
    text = _text()
    assert f"**TE's SwiGLU backward alone: {100 * swiglu:+.2f}%**" in text
    assert f"**The first micro-batch's writes alone: {100 * writes:+.2f}%**" in text
    assert f"is {-100 * candidate:.2f}% faster than the baseline" in text
    # the stalled step, and the pair read by its medians
    steps = [s["step_time_s"] for s in _json("mcore-swiglu.json")["steps"]]
    worst = max(steps[8:])
    assert f"one window step of {worst:.3f} s (step {steps.index(worst) + 1}), " \
           f"{worst / _median_step('mcore-swiglu'):.2f}x its median" in text
    shipped = (_median_step("shipped") + _median_step("shipped-again")) / 2
    assert f"`mcore-swiglu` {_median_step('mcore-swiglu'):.4f} s, against {shipped:.4f} s for the shipped runs " \
           f"({100 * (_median_step('mcore-swiglu') / shipped - 1):+.2f}%)" in text
    for run in RUNS:
        if run != "mcore-swiglu":
            r = _json(f"{run}.json")
            assert max(s["step_time_s"] for s in r["steps"][8:]) / _median_step(run) < 1.02, run


def test_the_kernel_figures_are_the_measurements():
    k = _json("kernels.json")
    text = _text()
    sw = k["swiglu"]
    mc = sw["megatron-core bias_swiglu_impl (compiled)"]
    te = sw["transformer_engine ops.SwiGLU"]
    mine = sw["the engine's: megatron-core's forward, TE's dswiglu backward"]
    assert f"it takes {mc['backward_ms']:.2f} ms, against {te['backward_ms']:.2f} ms for TE's " \
           f"({te['backward_gb_per_s']:,.0f} GB/s)" in text
    assert f"({mc['forward']['median_ms']:.2f} ms against TE's {te['forward']['median_ms']:.2f} ms)" in text
    assert f"| megatron-core's SwiGLU, forward + backward | {mc['forward_and_backward']['median_ms']:.2f} | " \
           f"backward {mc['backward_ms']:.2f} ms |" in text
    assert f"| TE's `ops.SwiGLU`, forward + backward | {te['forward_and_backward']['median_ms']:.2f} | " \
           f"forward {te['forward']['median_ms']:.2f} ms, backward {te['backward_ms']:.2f} ms |" in text
    ks = list(mine["forward_and_backward"]["kernels_ms"].values())
    assert f"| {mine['forward_and_backward']['median_ms']:.2f} | its kernels: {min(ks[:2]):.2f} + {max(ks[:2]):.2f} ms |" in text
    assert mine["forward_and_backward"]["median_ms"] < mc["forward_and_backward"]["median_ms"]
    norm = k["post_expert_norm"]
    default = norm["inductor default"]["backward"]
    kernels = list(default["kernels_ms"].values())
    assert f"as compiled | {default['median_ms']:.2f} | two kernels: the row pass ({kernels[0]:.2f} ms) and the " \
           f"weight's column sum ({kernels[1]:.2f} ms)" in text
    forced = norm["mix-order reduction forced (non-strict)"]["backward"]
    assert f"mix-order reduction forced | {forced['median_ms']:.2f} |" in text
    assert len(forced["kernels_ms"]) == len(default["kernels_ms"])  # not fused: the same kernels
    multi = norm["multi-kernel"]
    assert f"forward {multi['forward']['median_ms']:.2f} ms instead of {norm['inductor default']['forward']['median_ms']:.2f} ms" in text
    assert f"backward no faster ({multi['backward']['median_ms']:.2f} ms against {default['median_ms']:.2f} ms)" in text
    adam = k["adam"]
    first = adam[f"chunk {adam['default_chunk_size']}"]
    larger = [adam[f"chunk {c * adam['default_chunk_size']}"]["median_ms"] for c in (4, 16)]
    assert f"{adam['parameters'] / 1e9:.2f} B parameters | {first['median_ms']:.2f} | {first['gb_per_s']:,.0f} GB/s; " \
           f"{first['slice_ms_at_this_rate']:.1f} ms at the slice's 4.33 B; larger chunks are slower " \
           f"({larger[0]:.2f}, {larger[1]:.2f} ms)" in text
    assert min(larger) > first["median_ms"]
    z = k["zero_grad_buffer"]
    assert f"| zeroing 4.33 B fp32 | {z['median_ms']:.2f} | {z['gb_per_s']:,.0f} GB/s |" in text


def test_the_profile_figures_are_the_profile():
    p = _json("profile-shipped.json")
    before = json.loads((RESULTS / "levers7" / "profile-shipped.json").read_text())
    text = _text()
    assert (f"{p['span_seconds_per_step']:.4f} s of span, {p['busy_seconds_per_step']:.4f} s busy, "
            f"{1e3 * p['idle_seconds_per_step']:.1f} ms idle "
            f"({100 * p['idle_seconds_per_step'] / p['span_seconds_per_step']:.1f}%)") in text
    classes = {c["class"]: c for c in p["classes"]}
    old = {c["class"]: c for c in before["classes"]}
    for name, c in classes.items():
        if c["seconds_per_step"] > 0:
            assert f"| {name} | {1e3 * c['seconds_per_step']:.1f} |" in text, name
    ew, ew_old = classes["norms and elementwise"], old["norms and elementwise"]
    assert f"Norms and elementwise: {1e3 * ew['seconds_per_step']:.1f} ms, against {1e3 * ew_old['seconds_per_step']:.1f} ms" in text

    def site(c, words):
        return sum(s["seconds_per_step"] for s in c["top_sites"] if words in s["kernel"] + s["operators"])

    assert f"`dgated_act_kernel`: {1e3 * site(ew, 'dgated_act_kernel'):.2f} ms a step, where megatron-core's was " \
           f"{1e3 * site(ew_old, 'triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split'):.2f} ms" in text
    assert site(ew, "aten::zero_") == 0 and f"`aten::zero_` ({1e3 * site(ew_old, 'aten::zero_'):.2f} ms)" in text
    gemm = lambda q: sum(c["seconds_per_step"] for c in q["classes"] if "GEMM" in c["class"])  # noqa: E731
    assert f"The GEMMs are {1e3 * gemm(p):.1f} ms, against {1e3 * gemm(before):.1f} ms there" in text
    norm_bwd = site(ew, "CompiledFunctionBackward[[131072,4096]]")
    assert f"the largest elementwise pass, {1e3 * norm_bwd:.1f} ms a step" in text
