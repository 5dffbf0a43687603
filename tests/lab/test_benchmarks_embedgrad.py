"""The word embedding's gradient into main_grad and the norm backward with it, measured
(benchmarks/results/embedgrad/): embedgrad_choose.py's rule on made-up runs, the committed verdict recomputed from the
committed runs, the engine options' defaults equal to it, and each run's levers read back from what the engine
recorded (the README's figures are rendered from the same files: test_benchmarks_rendered.py). CPU only; nothing is
timed."""

from __future__ import annotations

import json

import pytest
from bench_results import RESULTS, Folder, script

FOLDER = Folder("embedgrad")
choose = script("embedgrad_choose")
_json = FOLDER.json
INTO, DENSE = "each token's gradient added into the fp32 main gradient (embedding_grad.py)", "a dense bf16 gradient"
ONE_PASS, INDUCTOR = "one Triton pass (norm_backward.py)", "the compiled chain's (TorchInductor)"


def _runs(tmp_path, **tps):
    for name, value in tps.items():
        (tmp_path / f"{name.rstrip('_').replace('_', '-')}.json").write_text(json.dumps({"tokens_per_s_per_gpu": value}))
    return choose.verdict(tmp_path)


def test_the_rule_on_made_up_runs(tmp_path):
    # drift 0.1% (threshold 0.5%): the embedding alone +1%, kept; the norm backward on top +0.3%, not
    r = _runs(tmp_path, with_=100.0, with_again=100.1, without=99.05, both=100.35)
    assert r["embedding_into_main_grad_kept"] and not r["one_pass_norm_backward_kept"]
    assert r["embedding_alone"] == pytest.approx(100.05 / 99.05 - 1)
    # the embedding alone +0.3% and the pair +1%: both kept (the pair was named before the measurement)
    r = _runs(tmp_path, with_=100.0, with_again=100.0, without=99.7, both=100.7)
    assert r["embedding_into_main_grad_kept"] and r["one_pass_norm_backward_kept"]
    # neither: the pair +0.4%
    r = _runs(tmp_path, with_=100.0, with_again=100.0, without=99.7, both=100.1)
    assert not r["embedding_into_main_grad_kept"] and not r["one_pass_norm_backward_kept"]
    # a drift of 1% raises the bar to 2%: a pair at +1.5% is not kept
    r = _runs(tmp_path, with_=100.0, with_again=101.0, without=99.5, both=101.0)
    assert r["threshold"] == pytest.approx(2 / 100.5) and not r["embedding_into_main_grad_kept"]
    (tmp_path / "both.json").unlink()
    with pytest.raises(SystemExit, match="both.json is missing"):
        choose.verdict(tmp_path)


def test_each_run_ran_what_it_is_named_for():
    for run in ("with", "without", "with-again", "both"):
        levers = _json(f"{run}.json")["levers"]
        assert levers["embedding_grad"].startswith(DENSE if run == "without" else INTO), run
        assert levers["post_expert_norm_backward"] == (ONE_PASS if run == "both" else INDUCTOR), run
        r = _json(f"{run}.json")
        assert r["overrides"] == [] and r["recipe"] == "slice-1gpu"
        assert r["method"] == "20 steps, window steps 9-20; each step bracketed by torch.cuda.synchronize()"
    gpu = (FOLDER.path / "gpu-test.txt").read_text()
    assert "4 passed" in gpu and "failed" not in gpu


def test_the_committed_verdict_is_the_rule(capsys):
    r = choose.verdict(FOLDER.path)
    assert r == _json("verdict.json")
    assert r["embedding_into_main_grad_kept"] and r["one_pass_norm_backward_kept"]
    assert choose.main([str(FOLDER.path)]) == 0
    printed = capsys.readouterr().out
    assert printed in (FOLDER.path / "verdict.txt").read_text()
    # what the engine runs unset: each option's default in the engine option table
    from muse_stack.recipes.options import BY_KEY

    for key in ("embedding_into_main_grad", "one_pass_norm_backward"):
        assert BY_KEY[key].default == ("on" if r[f"{key}_kept"] else "off"), key


def test_the_peak_grew_by_the_micro_batchs_token_gradients_in_fp32():
    """The embedding's change adds the micro-batch's 16,384 token gradients in fp32 (16,384 x 8,192 x 4 bytes)."""
    peak = {run: _json(f"{run}.json")["peak_memory_gib"] for run in ("with", "without")}
    assert 16_384 * 8_192 * 4 == pytest.approx((peak["with"] - peak["without"]) * 2**30, rel=1e-3)


def test_the_sitting_with_them_is_the_one_the_readme_names():
    runner = [json.loads((RESULTS / "side-by-side" / "2026-12-04" / f"runner{i}" / "results.json").read_text())
              for i in (1, 2, 3)]
    for r in runner:
        assert r["engine_info"]["levers"]["embedding_grad"] == INTO
        assert r["engine_info"]["levers"]["post_expert_norm_backward"] == ONE_PASS
