"""Adam's update as one Triton launch per parameter group, measured (benchmarks/results/adam/): each run's Adam read
back from what the engine recorded, and the verdict by the rule recomputed from the committed result files (the
README's figures are rendered from the same files: test_benchmarks_rendered.py; the launch the kernel reads, the fastest of the committed timings,
is tests/lab/test_benchmarks_datafiles.py's). CPU only; nothing is timed."""

from __future__ import annotations

import re

from bench_results import Folder, script

FOLDER = Folder("adam")
RUNS = ("with", "without", "with-again", "with-norm-backward")
TRITON, TE = "one Triton launch per parameter group (adam_step.py)", "Transformer Engine's multi_tensor_adam"
choose = script("adam_choose")
_json = FOLDER.json


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
    assert len(counts) == 2 and counts[0][1] == counts[1][1]


def test_the_verdict_is_the_rule_on_the_committed_runs():
    r = script("normbwd_choose").keep(FOLDER.path)  # adam_choose.py keep runs it
    assert r["kept"] is True
    FOLDER.assert_verdict(r, "kept")
    on_top = FOLDER.tps("with-norm-backward") / ((r["with"][0] + r["with"][1]) / 2) - 1
    assert on_top < r["threshold"]  # the one-pass norm backward on top: "below the rule's 0.5% again"


def test_the_committed_launches_are_the_grid_and_the_fastest_is_inside_it():
    kernels = _json("kernels.json")
    best = choose.fastest(kernels)
    te = kernels["adam"][f"chunk {kernels['adam']['default_chunk_size']}"]
    assert best["step"]["median_ms"] < te["median_ms"]  # the Triton step alone beats TE's
    launches = kernels["adam"][choose.LAUNCHES_KEY]
    grid = {(x["programs_per_sm"], x["num_warps"], x["block"]) for x in launches}
    assert grid == set(script("kernels").ADAM_LAUNCHES) and len(grid) == 24
    first = choose.fastest(_json("kernels-first-grid.json"))
    assert (first["programs_per_sm"], first["num_warps"], first["block"]) == (8, 8, 1024)
    beyond = {(x["programs_per_sm"], x["block"]): x["step"]["median_ms"]
              for x in _json("kernels-beyond.json")["adam"][choose.LAUNCHES_KEY]}
    assert min(beyond.values()) > 0.99 * beyond[(32, 1024)], "nothing beyond the grid is more than 1% faster"
