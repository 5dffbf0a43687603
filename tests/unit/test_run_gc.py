"""Steady steps: Python's garbage collector as a recipe setting (``training.gc``, Megatron-Bridge's
``train.manual_gc*`` keys as aliases), and the step-time median and worst window step in results.json."""

from __future__ import annotations

import gc
import json
import statistics

import pytest

from muse_stack.recipes.catalogue import load_recipe
from muse_stack.run.pipeline import run


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, one_thread):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_the_default_is_manual_collection_recorded_in_the_resolved_recipe():
    recipe = load_recipe("tiny-cpu")
    assert recipe.training.gc.model_dump() == {"manual": True, "interval": 100, "eval": True}
    bridge = load_recipe("tiny-cpu", ["train.manual_gc=false", "train.manual_gc_interval=7",
                                      "train.manual_gc_eval=false"])
    assert bridge.training.gc.model_dump() == {"manual": False, "interval": 7, "eval": False}
    from muse_stack.recipes.catalogue import recipe_yaml

    assert "gc:" in recipe_yaml(recipe) and "interval: 100" in recipe_yaml(recipe)


def test_manual_collection_happens_on_the_stated_steps_only(tmp_path, monkeypatch):
    """Every collection the interpreter makes while the run trains is seen by gc.callbacks: with the
    collector off they are the run's own, after steps 3 and 6 (every 3rd) and after the saves at 4
    and 8."""
    from muse_stack.run.steps import TrainSteps
    from muse_stack.run.trainer import Trainer

    state = {"done": 0, "training": False}
    real_step, real_finish = TrainSteps.step, Trainer.finish

    def train_step(self, n):
        state["training"] = True
        out = real_step(self, n)
        state["done"] = n
        return out

    def finish(self):
        state["training"] = False
        return real_finish(self)

    seen: list[int] = []

    def callback(phase, info):
        if phase == "start" and state["training"]:
            seen.append(state["done"])

    monkeypatch.setattr(TrainSteps, "step", train_step)
    monkeypatch.setattr(Trainer, "finish", finish)
    gc.callbacks.append(callback)
    try:
        out = run("tiny-cpu", out=tmp_path / "gc", steps=8, progress=False,
                  overrides=["batch.gbs=2", "training.measure_warmup_steps=1", "training.checkpoint_interval=4",
                             "training.gc.interval=3"])
    finally:
        gc.callbacks.remove(callback)
    assert out.status == "completed"
    assert seen == [3, 4, 6, 8]
    assert out.results["gc"] == {"manual": True, "interval": 3, "eval": True, "collections_by_hand": 4}
    assert gc.isenabled()  # the run gives the collector back
    rows = [json.loads(line) for line in (out.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["gc_s"] > 0] == [3, 6]  # timed into the steps they follow


def test_results_report_the_median_and_the_worst_window_step(tmp_path):
    out = run("tiny-cpu", out=tmp_path / "med", steps=6, progress=False,
              overrides=["batch.gbs=2", "training.measure_warmup_steps=2"])
    r = json.loads((out.path / "results.json").read_text())
    rows = [json.loads(line) for line in (out.path / "metrics.jsonl").read_text().splitlines()]
    window = rows[r["window"][0] - 1:r["window"][1]]
    times = [m["step_time_s"] for m in window]
    # the same float64 numbers through the same operations: equal exactly
    assert r["step_time_median_s"] == statistics.median(times)
    worst = max(window, key=lambda m: m["step_time_s"])
    assert r["step_time_worst_step"] == worst["step"]
    assert r["step_time_worst_ratio"] == worst["step_time_s"] / statistics.median(times)
    assert r["step_time_worst_ratio"] >= 1.0 and r["step_time_mean_s"] == statistics.fmean(times)


def test_the_summary_prints_median_and_worst_step(tmp_path, cli):
    rc, text, err = cli("run", "tiny-cpu", "--out", tmp_path / "s", "--no-progress", "--steps", "4", "batch.gbs=2",
                        "training.measure_warmup_steps=1")
    assert rc == 0, err
    r = json.loads((tmp_path / "s" / "results.json").read_text())
    assert f"median {r['step_time_median_s']:.4g} s" in text
    assert f"slowest step {r['step_time_worst_step']} at {r['step_time_worst_ratio']:.2f}x" in text
