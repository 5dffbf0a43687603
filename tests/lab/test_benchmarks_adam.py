"""Adam's update as one Triton launch per parameter group, measured (benchmarks/results/adam/): every figure its
README states, recomputed from the committed result files; each run's Adam read back from what the engine recorded;
and the verdict by the rule (the launch the kernel reads, the fastest of the committed timings, is
tests/lab/test_benchmarks_datafiles.py's). CPU only; nothing is timed."""

from __future__ import annotations

import re

from bench_results import Folder, script

FOLDER = Folder("adam")
RUNS = ("with", "without", "with-again", "with-norm-backward")
TRITON, TE = "one Triton launch per parameter group (adam_step.py)", "Transformer Engine's multi_tensor_adam"
choose = script("adam_choose")
_json, _text = FOLDER.json, FOLDER.text


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_each_run_ran_the_step_it_is_named_for():
    for run in RUNS:
        r = _json(f"{run}.json")
        assert r["levers"]["adam_step"].startswith(TE if run == "without" else TRITON), run
        assert ("stepped by one Triton launch" in r["optimizer"][0]) is (run != "without"), run
        norm = r["levers"]["post_expert_norm_backward"]
        assert (norm == "one Triton pass (norm_backward.py)") is (run == "with-norm-backward"), run
        assert r["overrides"] == [] and r["recipe"] == "slice-1gpu"
        assert r["method"] == "20 steps, window steps 9-20; each step bracketed by torch.cuda.synchronize()"
    gpu = (FOLDER.path / "gpu-test.txt").read_text()
    assert "11 passed" in gpu and "failed" not in gpu
    counts = [tuple(int(x) for x in m) for m in re.findall(r": (\d+) of (\d+) master and moment elements", gpu)]
    assert len(counts) == 2
    text = _flat(_text())
    assert f"{counts[0][0]:,} and {counts[1][0]:,} of {counts[0][1]:,} master and moment elements " \
           f"({100 * counts[0][0] / counts[0][1]:.2f}%)" in text


def test_the_verdict_is_the_rule_on_the_committed_runs():
    r = script("normbwd_choose").keep(FOLDER.path)  # adam_choose.py keep runs it
    assert r["kept"] is True
    assert f"**+{100 * r['gain']:.2f}% by the rule's measure: kept.**" in _text()
    FOLDER.assert_verdict(r, "kept")
    on_top = FOLDER.tps("with-norm-backward") / ((r["with"][0] + r["with"][1]) / 2) - 1
    assert f"+{100 * on_top:.2f}% against the same baseline, below the rule's 0.5% again" in _text()
    assert on_top < r["threshold"]


def test_the_readme_table_restates_each_run():
    FOLDER.assert_run_table_with_median(RUNS)


def test_the_readme_states_the_fastest_committed_launch():
    kernels = _json("kernels.json")
    best = choose.fastest(kernels)
    text = (FOLDER.path / "README.md").read_text()
    assert f"| **the Triton step, the fastest launch ({best['programs_per_sm']} per SM, {best['num_warps']} warps, " \
           f"{best['block']:,} elements)** | **{best['step']['median_ms']:.2f}** | **{best['step']['gb_per_s']:,.0f}** |" \
           in text
    te = kernels["adam"][f"chunk {kernels['adam']['default_chunk_size']}"]
    assert f"| TE's `multi_tensor_adam` (its 65,536-element chunks) | {te['median_ms']:.2f} | {te['gb_per_s']:,.0f} |" \
        in text
    launches = kernels["adam"][choose.LAUNCHES_KEY]
    grid = {(x["programs_per_sm"], x["num_warps"], x["block"]) for x in launches}
    assert grid == set(script("kernels").ADAM_LAUNCHES) and len(grid) == 24
    first = choose.fastest(_json("kernels-first-grid.json"))
    assert (first["programs_per_sm"], first["num_warps"], first["block"]) == (8, 8, 1024)
    again = next(x for x in launches if (x["programs_per_sm"], x["num_warps"], x["block"]) == (8, 8, 1024))
    assert f"| the Triton step, the first grid's fastest (8 per SM, 8 warps, 1,024 elements) | " \
           f"{again['step']['median_ms']:.2f} | {again['step']['gb_per_s']:,.0f} |" in text
    beyond = {(x["programs_per_sm"], x["block"]): x["step"]["median_ms"]
              for x in _json("kernels-beyond.json")["adam"][choose.LAUNCHES_KEY]}
    assert f"({beyond[(64, 1024)]:.2f} and {beyond[(128, 1024)]:.2f} ms against {beyond[(32, 1024)]:.2f} ms in the " \
           "same call)" in _flat(text)
    assert min(beyond.values()) > 0.99 * beyond[(32, 1024)], "nothing beyond the grid is more than 1% faster"


def test_the_profile_figures_are_the_profile():
    p = _json("profile-shipped.json")
    text = _flat(_text())
    classes = {c["class"]: c for c in p["classes"]}
    kernels = dict(classes["optimizer"]["top_kernels"])
    norm = next(v for k, v in kernels.items() if "L2NormFunctor" in k)
    assert f"**The optimizer:** {1e3 * classes['optimizer']['seconds_per_step']:.2f} ms a step" in text
    assert f"(`_adam`) is {1e3 * kernels['_adam']:.2f} ms: {4_328_521_728 * 30 / kernels['_adam'] / 1e12:.1f} TB/s" in text
    assert f"(`multi_tensor_l2norm`) is {1e3 * norm:.2f} ms: 17.3 GB read at {4_328_521_728 * 4 / norm / 1e12:.1f} TB/s" \
        in text
    gemm = classes["grouped expert GEMM"]["seconds_per_step"] + classes["dense GEMM"]["seconds_per_step"]
    assert f"{1e3 * gemm:.1f} ms of the {1e3 * p['busy_seconds_per_step']:.1f} ms busy" in text
    assert f"{p['span_seconds_per_step']:.4f} s of span, {p['busy_seconds_per_step']:.4f} s busy, " \
           f"{1e3 * p['idle_seconds_per_step']:.1f} ms idle" in text
