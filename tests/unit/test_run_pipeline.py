"""The run pipeline end to end on the CPU reference engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muse_stack.run.pipeline import run

ROOT = Path(__file__).resolve().parents[2]
FILES = ("recipe.yaml", "fingerprint.json", "metrics.jsonl", "results.json", "loss.png", "throughput.png", "run.log")


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    return run("tiny-cpu", out=out, progress=False), None


@pytest.mark.slow
def test_tiny_cpu_demo_run(tiny_run):
    outcome, _ = tiny_run
    path = outcome.path
    assert outcome.status == "completed"
    for name in FILES:
        assert (path / name).is_file(), name
    rows = metrics(path)
    results = json.loads((path / "results.json").read_text())
    assert len(rows) >= 50 and results["steps_completed"] == len(rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[-1]["loss"] <= 0.7 * rows[0]["loss"], "loss must fall by at least 30%"
    assert (path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_results_are_consistent_with_metrics(tiny_run):
    path = tiny_run[0].path
    rows = metrics(path)
    r = json.loads((path / "results.json").read_text())
    first, last = r["window"]
    window = rows[first - 1:last]
    assert first == r["warmup_steps"] + 1 and last == len(rows)
    tps = sum(m["tokens"] for m in window) / sum(m["step_time_s"] for m in window) / r["world_size"]
    # float64 sums of the same <= 60 numbers in another order: <= 60 x 1.1e-16 = 7e-15 relative
    assert r["tokens_per_s_per_gpu"] == pytest.approx(tps, rel=1e-12)
    assert r["window_tokens"] == sum(m["tokens"] for m in window)
    flops = r["flops_per_token"]["training"]
    assert r["model_tflops_per_gpu"] == pytest.approx(flops * tps / 1e12)
    assert r["mfu"] == pytest.approx(r["model_tflops_per_gpu"] / r["peak_tflops"])
    assert r["mfu_6n"] == pytest.approx(6 * r["active_params"] * tps / 1e12 / r["peak_tflops"])
    assert r["peak_source"].startswith("measured on this CPU")
    assert r["first_loss"] == rows[0]["loss"] and r["final_loss"] == rows[-1]["loss"]


@pytest.mark.slow
def test_fingerprint_beside_results(tiny_run):
    path = tiny_run[0].path
    fp = json.loads((path / "fingerprint.json").read_text())
    from muse_stack.recipes.catalogue import load_recipe, recipe_sha256
    import yaml

    from muse_stack.recipes.catalogue import parse_recipe

    resolved = parse_recipe(yaml.safe_load((path / "recipe.yaml").read_text()), "recipe.yaml")
    assert fp["run_inputs"]["recipe_sha256"] == recipe_sha256(resolved)
    assert len(fp["run_inputs"]["rows_sha256"]) == 64
    assert resolved == load_recipe("tiny-cpu")


@pytest.mark.slow
def test_existing_run_directory_is_refused(tiny_run, cli):
    path = tiny_run[0].path
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    rc, _, err = cli("run", "tiny-cpu", "--out", path, "--no-progress")
    assert rc == 3 and "already exists" in err and "--out" in err
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_bad_input_writes_nothing(tmp_path, cli):
    out = tmp_path / "never"
    rc, _, err = cli("run", "tiny-cpu", "layout.tp=3", "--out", out, "--no-progress")
    assert rc == 2 and "layout.tp" in err and not out.exists()
    rc, _, err = cli("run", "no-such-recipe", "--out", out)
    assert rc == 2 and not out.exists()


@pytest.mark.parametrize("override, field", [("layout.vpp=2", "layout.vpp"),
                                             ("recompute.modules=[mlp]", "recompute.modules")])
def test_what_the_gpu_engine_refuses_is_refused_before_any_output(tmp_path, cli, override, field):
    """The megatron engine's own refusals (interleaved stages, unknown selective-recompute
    modules) come from the recipe check, on any machine, before the run directory exists."""
    out = tmp_path / "gpu"
    extra = ["recompute.granularity=selective"] if field == "recompute.modules" else []
    rc, _, err = cli("run", "proxy-2gpu", *extra, override, "--out", out, "--no-progress")
    assert rc == 2 and not out.exists()
    assert field in err and "fix:" in err


def test_gpu_recipe_without_gpu_says_so(tmp_path, cli):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "gpu"
    rc, _, err = cli("run", "proxy-1gpu", "--out", out, "--no-progress")
    assert rc == 2 and "megatron-core engine" in err and "CUDA is not available" in err
    assert not out.exists()


@pytest.mark.slow
def test_interrupt_then_resume_matches_an_uninterrupted_run(tmp_path):
    common = dict(overrides=["training.measure_warmup_steps=2"], steps=12, progress=False)
    full = run("tiny-cpu", out=tmp_path / "full", **common)
    part = run("tiny-cpu", out=tmp_path / "part", stop_after=5, **common)
    assert part.status == "interrupted"
    res = json.loads((part.path / "results.json").read_text())
    assert res["status"] == "interrupted" and res["steps_completed"] == 5
    assert len(metrics(part.path)) == 5 and (part.path / "checkpoints" / "step-00000005" / "config.json").is_file()
    done = run(resume=part.path, progress=False)
    assert done.status == "completed" and done.results["resumed_at_step"] == 5
    a, b = metrics(full.path), metrics(done.path)
    assert [m["step"] for m in b] == list(range(1, 13))
    # the resumed steps repeat the same float32 operations, in the same order and with the same
    # threads, from state saved bit for bit (fp32 safetensors, Adam's state, the RNG): equal exactly
    assert [m["loss"] for m in b] == [m["loss"] for m in a]


@pytest.mark.slow
def test_stop_after_from_the_command_line_then_resume(tmp_path, cli):
    out = tmp_path / "stop"
    rc, text, _ = cli("run", "tiny-cpu", "--steps", "4", "--stop-after", "2", "--out", out, "--no-progress",
                      "training.measure_warmup_steps=1")
    assert rc == 1 and "interrupted" in text
    assert json.loads((out / "results.json").read_text())["steps_completed"] == 2
    assert json.loads((out / "checkpoints" / "latest").read_text())["step"] == 2
    rc, text, _ = cli("run", "--resume", out, "--no-progress")
    assert rc == 0 and "completed" in text
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_refuses_a_completed_run(tiny_run, cli):
    rc, _, err = cli("run", "--resume", tiny_run[0].path)
    assert rc == 3 and "nothing to continue" in err


@pytest.mark.slow
def test_sigterm_leaves_an_interrupted_run(tmp_path):
    out = tmp_path / "term"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "muse_stack.cli", "run", "tiny-cpu", "--steps", "2000",
                             "--out", str(out), "--no-progress"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 90
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err.decode()
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "interrupted"
    rows = metrics(out)
    assert res["steps_completed"] == len(rows) >= 3
    assert (out / "checkpoints" / f"step-{len(rows):08d}" / "model.safetensors").is_file()


@pytest.mark.slow
def test_export_a_run_as_an_openrecipes_record(tiny_run, cli, tmp_path):
    from muse_stack.recipes.openrecipes import import_record

    path = tiny_run[0].path
    out = tmp_path / "record.yaml"
    rc, _, _ = cli("record", "export", path, "-o", out)
    assert rc == 0
    again = import_record(out, "mine")
    results = json.loads((path / "results.json").read_text())
    fp = json.loads((path / "fingerprint.json").read_text())
    assert again.result.tokens_per_s_per_gpu == pytest.approx(results["tokens_per_s_per_gpu"])
    assert again.data.rows_sha256 == fp["run_inputs"]["rows_sha256"]
    assert again.stack.pytorch.startswith(fp["frameworks"]["torch"]["version"])
    rc, _, err = cli("record", "export", path, "-o", out)
    assert rc == 3 and "exists" in err
