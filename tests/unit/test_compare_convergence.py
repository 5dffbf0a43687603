"""Convergence and performance comparison of run directories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from muse_stack.cli import main
from muse_stack.compare.convergence import PRESETS, Thresholds, check_convergence, parse_skip, step_ranges
from muse_stack.compare.runcompare import Gates, compare_runs
from muse_stack.compare.runs import Metrics, StepRecord

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/fingerprints"


def curve(n: int = 50, seed: int = 0, scale: float = 1.0, noise: float = 0.01) -> list[float]:
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    return list((2.4 * np.exp(-steps / 15) + 1.1) * scale + rng.normal(0, noise, n))


def metrics(losses: list[float], steps: list[int] | None = None, grads: list[float] | None = None) -> Metrics:
    steps = steps or list(range(1, len(losses) + 1))
    grads = grads or [1.0] * len(losses)
    return Metrics(file=Path("metrics.jsonl"),
                   steps=[StepRecord(s, l, g, {}) for s, l, g in zip(steps, losses, grads)])


def failed(result) -> dict[str, str]:
    return {c.name: c.detail for c in result.checks if not c.passed}


def test_identical_runs_pass():
    g = curve()
    result = check_convergence(metrics(g), metrics(list(g)))
    assert result.passed, failed(result)
    corr = next(c for c in result.checks if c.name == "correlation")
    assert corr.value == pytest.approx(1.0)


def test_close_run_passes_with_bridge_thresholds():
    result = check_convergence(metrics(curve(seed=0)), metrics(curve(seed=1)))
    assert result.passed, failed(result)


def test_truncated_candidate_fails_and_names_the_steps():
    g = curve(50)
    result = check_convergence(metrics(g), metrics(g[:30]))
    f = failed(result)
    assert not result.passed
    assert "candidate is missing steps 31-50" in f["no missing steps"]
    assert "golden has 50 steps" in f["equal lengths"] and "candidate 30" in f["equal lengths"]


def test_nan_loss_or_grad_norm_fails():
    g = curve(20)
    c = list(g)
    c[6] = math.nan
    grads = [1.0] * 20
    grads[11] = math.inf
    result = check_convergence(metrics(g), metrics(c, grads=grads))
    f = failed(result)
    assert list(f) == ["finite loss and grad norm"]
    assert "candidate loss not finite (NaN/Inf/null) at steps 7" in f["finite loss and grad norm"]
    assert "candidate grad_norm not finite (NaN/Inf/null) at steps 12" in f["finite loss and grad norm"]


def test_longer_candidate_is_a_length_mismatch():
    result = check_convergence(metrics(curve(40)), metrics(curve(45)))
    f = failed(result)
    assert "equal lengths" in f
    assert "golden is missing steps 41-45" in f["no missing steps"]


def test_step_missing_in_the_middle_fails():
    g = curve(20)
    steps = [s for s in range(1, 21) if s not in (5, 6, 11)]
    result = check_convergence(metrics(g), metrics([g[s - 1] for s in steps], steps=steps))
    assert "candidate is missing steps 5-6, 11" in failed(result)["no missing steps"]


def test_the_same_step_missing_from_both_still_fails():
    g = curve(20)
    steps = [s for s in range(1, 21) if s != 9]
    result = check_convergence(metrics([g[s - 1] for s in steps], steps=steps),
                               metrics([g[s - 1] for s in steps], steps=steps))
    f = failed(result)
    assert "golden is missing steps 9" in f["no missing steps"] and "candidate is missing steps 9" in f["no missing steps"]


def test_diverging_run_fails_statistical_checks():
    g = curve(50)
    c = [v * (1 + 0.004 * i) for i, v in enumerate(g)]  # drifts to +20%
    result = check_convergence(metrics(g), metrics(c))
    f = failed(result)
    assert "point-wise tolerance" in f and "final loss" in f


def test_pointwise_tolerance_depends_on_golden_magnitude():
    t = Thresholds()
    assert t.tolerance_for(2.5) == 0.10 and t.tolerance_for(2.0) == 0.05
    assert t.tolerance_for(0.6) == 0.05 and t.tolerance_for(0.5) == 0.02
    low = [0.4] * 10
    ok = [0.4 * 1.015] * 10  # 1.5% off at loss 0.4: inside 2%
    bad = [0.4 * 1.03] * 10  # 3% off: outside 2%
    assert "point-wise tolerance" not in failed(check_convergence(metrics(low), metrics(ok)))
    assert "point-wise tolerance" in failed(check_convergence(metrics(low), metrics(bad)))


def test_thresholds_and_skip_are_overridable():
    g = curve(50)
    c = list(g)
    for i in range(10):  # wild first 20% only
        c[i] = g[i] * 1.5
    assert not check_convergence(metrics(g), metrics(c)).passed
    result = check_convergence(metrics(g), metrics(c), Thresholds(skip_first=0.2))
    assert result.passed and result.skipped == 10 and result.steps[0] == 11
    strict = check_convergence(metrics(curve(seed=0)), metrics(curve(seed=1)), Thresholds(final_loss_tolerance=1e-9))
    assert "final loss" in failed(strict)


def test_outlier_check():
    g = curve(50, noise=0.0)
    c = list(g)
    for i in (10, 30, 45):  # 3 of 50 points far off: 6% outliers
        c[i] += 0.05
    result = check_convergence(metrics(g), metrics(c), Thresholds(max_outlier_ratio=0.05, max_pointwise_failure_ratio=1))
    assert "3-sigma outliers" in failed(result)
    assert "at steps 11, 31, 46" in failed(result)["3-sigma outliers"]
    assert "3-sigma outliers" not in failed(check_convergence(metrics(g), metrics(c), Thresholds(max_pointwise_failure_ratio=1)))


def test_step_ranges():
    assert step_ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert step_ranges([]) == ""


# --- run directories and the command line -------------------------------------------------------


def make_run(root: Path, name: str, losses, *, tps: float = 505.0, mem: float | None = 120.0,
             grads=None, fingerprint: dict | None = None, status: str = "completed") -> Path:
    run = root / name
    run.mkdir()
    lines = []
    for i, loss in enumerate(losses, start=1):
        g = grads[i - 1] if grads else 1.0 + 0.01 * i
        lines.append(json.dumps({"step": i, "loss": loss, "grad_norm": g, "lr": 1e-5, "step_time_s": 2.0,
                                 "tokens": 1024, "tokens_per_s": tps * 8, "tokens_per_s_per_gpu": tps,
                                 "peak_memory_gib": mem}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    n = len(losses)
    (run / "results.json").write_text(json.dumps({
        "status": status, "steps_completed": n, "window": [min(5, n), max(n - 1, 1)], "tokens_per_s_per_gpu": tps,
        "step_time_cv_percent": 1.5, "model_tflops_per_gpu": 60.0 * tps / 505.0, "mfu": 0.06 * tps / 505.0,
        "peak_memory_gib": mem, "world_size": 8, "device": "cuda", "engine": "megatron-core"}))
    if fingerprint is not None:
        (run / "fingerprint.json").write_text(json.dumps(fingerprint))
    return run


def test_cli_compare_identical_runs_pass_and_plot(tmp_path, capsys):
    fp = json.loads((FIXTURES / "crafted-b200-attune.json").read_text())
    a = make_run(tmp_path, "golden", curve(), fingerprint=fp)
    b = make_run(tmp_path, "candidate", curve(), fingerprint=fp)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "identical" in out
    png = b / "compare-golden.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_compare_truncated_run_fails_with_steps_and_json(tmp_path, capsys):
    a = make_run(tmp_path, "golden", curve(50), tps=505.0, mem=120.0)
    b = make_run(tmp_path, "died", curve(50)[:30], tps=480.0, mem=126.0, status="failed")
    plot = tmp_path / "plots" / "cmp.png"
    assert main(["compare", str(a), str(b), "--json", "--plot", str(plot)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False and out["exit_code"] == 1
    assert "no missing steps" in out["convergence"]["failed_checks"]
    detail = next(c["detail"] for c in out["convergence"]["checks"] if c["name"] == "no missing steps")
    assert "candidate is missing steps 31-50" in detail
    tps = out["performance"]["tokens_per_s_per_gpu"]
    assert tps["reference"] == 505.0 and tps["candidate"] == 480.0
    assert tps["delta_percent"] == pytest.approx((480 - 505) / 505 * 100)
    assert out["performance"]["peak_memory_gib"]["delta"] == pytest.approx(6.0)
    assert out["performance"]["candidate_status"] == "failed"
    assert out["fingerprint_diff"]["absent"].startswith("no fingerprint to compare")
    assert plot.exists()


def test_cli_compare_nan_fails(tmp_path):
    g = curve(20)
    c = list(g)
    c[4] = float("nan")  # json.dumps writes NaN
    a, b = make_run(tmp_path, "a", g), make_run(tmp_path, "b", c)
    assert main(["compare", str(a), str(b), "--no-plot"]) == 1
    assert not list(b.glob("*.png"))


def test_cli_compare_performance_gates(tmp_path, capsys):
    a = make_run(tmp_path, "a", curve(), tps=505.0, mem=100.0)
    b = make_run(tmp_path, "b", curve(), tps=470.0, mem=104.0)
    assert main(["compare", str(a), str(b), "--no-plot"]) == 0  # gates off by default
    assert main(["compare", str(a), str(b), "--no-plot", "--max-throughput-drop", "5"]) == 1
    assert main(["compare", str(a), str(b), "--no-plot", "--max-throughput-drop", "10", "--max-memory-increase", "5"]) == 0
    assert main(["compare", str(a), str(b), "--no-plot", "--max-memory-increase", "3"]) == 1
    report = compare_runs(a, b, gates=Gates(max_throughput_drop_percent=5), make_plot=False)
    assert report.gates[0]["passed"] is False and "-6.93%" in report.gates[0]["detail"]


def test_cli_compare_fingerprint_summary(tmp_path, capsys):
    fp = json.loads((FIXTURES / "crafted-b200-attune.json").read_text())
    other = json.loads(json.dumps(fp))
    other["frameworks"]["transformer_engine"]["version"] = "2.18.0"
    a = make_run(tmp_path, "a", curve(), fingerprint=fp)
    b = make_run(tmp_path, "b", curve(), fingerprint=other)
    assert main(["compare", str(a), str(b), "--json", "--no-plot"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fingerprint_diff"]["verdict"] == "numerics differ"
    assert out["fingerprint_diff"]["numerics"] == ["frameworks.transformer_engine.version"]


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda run: (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "grad_norm": 1.0}\n{"step": 2, "lo'),
         "line 2"),
        (lambda run: (run / "metrics.jsonl").unlink(), "metrics.jsonl does not exist"),
        (lambda run: (run / "results.json").write_text("{not json"), "results.json is not valid JSON"),
        (lambda run: (run / "fingerprint.json").write_text("{}"), "no schema_version"),
    ],
)
def test_cli_compare_unreadable_input_exits_3(tmp_path, capsys, setup, needle):
    a = make_run(tmp_path, "a", curve(10), fingerprint={"schema_version": 1})
    b = make_run(tmp_path, "b", curve(10), fingerprint={"schema_version": 1})
    setup(b)
    assert main(["compare", str(a), str(b), "--no-plot"]) == 3
    err = capsys.readouterr().err
    assert needle in err and str(b) in err


def test_cli_compare_missing_run_dir(tmp_path, capsys):
    a = make_run(tmp_path, "a", curve(10))
    assert main(["compare", str(a), str(tmp_path / "nope")]) == 3
    assert "does not exist" in capsys.readouterr().err


# --- the skip as a fraction, presets, flat golden curves ------------------------------------------


@pytest.mark.parametrize("text, fraction", [("0", 0.0), ("0.2", 0.2), ("20%", 0.2), ("0.5%", 0.005), (" 0.99 ", 0.99)])
def test_skip_is_a_fraction_like_bridge_or_a_signed_percent(text, fraction):
    assert parse_skip(text) == pytest.approx(fraction, rel=0, abs=1e-15)  # one float division: exact to an ulp


@pytest.mark.parametrize("text", ["20", "1", "1.0", "100%", "-0.1", "nan", "inf", "twenty"])
def test_ambiguous_or_invalid_skip_is_refused(text):
    with pytest.raises(ValueError):
        parse_skip(text)


def test_cli_skip_fraction_skips_and_ambiguous_value_exits_2(tmp_path, capsys):
    g = curve(50)
    c = list(g)
    for i in range(10):  # wild first 20% only
        c[i] = g[i] * 1.5
    a, b = make_run(tmp_path, "golden", g), make_run(tmp_path, "candidate", c)
    assert main(["compare", str(a), str(b), "--no-plot"]) == 1
    capsys.readouterr()
    assert main(["compare", str(a), str(b), "--no-plot", "--skip-first-percent", "0.2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["convergence"]["points_skipped"] == 10
    assert report["convergence"]["thresholds"]["skip_first"] == 0.2
    assert main(["compare", str(a), str(b), "--no-plot", "--skip-first", "20"]) == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "--skip-first" in err


def test_bridge_pipeline_preset_is_5_percent_final_and_skips_20_percent(tmp_path, capsys):
    assert PRESETS["bridge-pipeline"] == {"final_loss_tolerance": 0.05, "skip_first": 0.2}
    assert PRESETS["bridge-function"] == {"final_loss_tolerance": 0.03, "skip_first": 0.0}
    g = curve(50, noise=0.0)
    c = list(g)
    c[-1] = g[-1] * 1.04  # 4% off at the last step: outside 3%, inside 5%
    a, b = make_run(tmp_path, "golden", g), make_run(tmp_path, "candidate", c)
    assert main(["compare", str(a), str(b), "--no-plot", "--json"]) == 1
    assert "final loss" in json.loads(capsys.readouterr().out)["convergence"]["failed_checks"]
    assert main(["compare", str(a), str(b), "--no-plot", "--json", "--preset", "bridge-pipeline"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["convergence"]["points_skipped"] == 10
    # an explicit option overrides the preset
    assert main(["compare", str(a), str(b), "--no-plot", "--preset", "bridge-pipeline",
                 "--final-loss-tolerance", "0.03"]) == 1
    assert main(["compare", str(a), str(b), "--no-plot", "--preset", "nope"]) == 2


def test_flat_golden_curve_is_judged_on_pointwise_and_final_checks():
    flat = [2.5] * 30
    near = [2.5 * (1 + 0.001 * ((-1) ** i)) for i in range(30)]  # 0.1% wiggle: inside every tolerance
    result = check_convergence(metrics(flat), metrics(near))
    assert result.passed, failed(result)
    corr = next(c for c in result.checks if c.name == "correlation")
    assert corr.value is None and "flat" in corr.detail
    far = [2.5 * 1.2] * 30  # 20% above a flat golden: point-wise and final checks fail
    bad = failed(check_convergence(metrics(flat), metrics(far)))
    assert "point-wise tolerance" in bad and "final loss" in bad and "correlation" not in bad
    # a candidate that goes flat against a moving golden curve still fails on correlation
    assert "correlation" in failed(check_convergence(metrics(curve(30)), metrics([2.0] * 30)))
