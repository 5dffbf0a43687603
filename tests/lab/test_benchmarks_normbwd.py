"""The post-expert norm's one-pass backward, measured (benchmarks/results/normbwd/): each run's backward read back
from what the engine recorded, and the verdict by the rule recomputed from the committed result files (the README's
figures are rendered from the same files: test_benchmarks_rendered.py; the launch the kernel reads, the fastest of the committed timings,
is tests/lab/test_benchmarks_datafiles.py's). CPU only; nothing is timed."""

from __future__ import annotations


from bench_results import Folder, script

FOLDER = Folder("normbwd")
RUNS = ("with", "without", "with-again")
ONE_PASS, INDUCTOR = "one Triton pass (norm_backward.py)", "the compiled chain's (TorchInductor)"
choose = script("normbwd_choose")
_json = FOLDER.json


def test_each_run_ran_the_backward_it_is_named_for():
    for run in RUNS:
        r = _json(f"{run}.json")
        assert r["levers"]["post_expert_norm_backward"] == (INDUCTOR if run == "without" else ONE_PASS), run
        assert r["overrides"] == [] and r["recipe"] == "slice-1gpu"
        assert r["method"] == "20 steps, window steps 9-20; each step bracketed by torch.cuda.synchronize()"
    assert "1 passed" in (FOLDER.path / "gpu-test.txt").read_text()


def test_the_verdict_is_the_rule_on_the_committed_runs():
    r = choose.keep(FOLDER.path)
    assert r["kept"] is False
    FOLDER.assert_verdict(r, "rejected")


def test_the_committed_launches_are_the_grid_and_the_fastest_beats_the_compiled_backward():
    kernels = _json("kernels.json")
    best = choose.fastest(kernels)
    inductor = kernels["post_expert_norm"]["inductor default"]["backward"]
    assert best["backward"]["median_ms"] < inductor["median_ms"]  # "faster alone"
    # the grid kernels.py timed is the grid the GPU test checks
    launches = kernels["post_expert_norm"][choose.LAUNCHES_KEY]
    grid = {(x["programs_per_sm"], x["num_warps"], x["rows_per_iteration"]) for x in launches}
    assert grid == set(script("kernels").LAUNCHES) and len(grid) == 18


def test_the_engine_runs_it_since_the_embedding_measurement():
    """Off by this folder's verdict; on since benchmarks/results/embedgrad/, where it was kept with the embedding's
    change (its test checks the option's default against that verdict)."""
    from muse_stack.recipes.options import BY_KEY

    assert BY_KEY["one_pass_norm_backward"].default == "on"
    assert "it is on since `embedgrad/`" in " ".join(
        (FOLDER.path.parents[2] / "docs" / "gpu-engine.md").read_text().split())
