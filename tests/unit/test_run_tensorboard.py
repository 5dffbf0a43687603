"""The TensorBoard sink writes event files that TensorBoard's own reader reads back; the recipe's
logging section and the W&B mode choice."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from muse_stack.util.errors import RecipeError  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe, recipe_yaml  # noqa: E402
from muse_stack.run.tensorboard import TENSORBOARD_DIR, TensorBoardLogger, sinks_for, wandb_mode  # noqa: E402


def _read(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(acc, tag):
    return acc.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()


def test_events_read_back_with_tensorboards_reader(tmp_path):
    recipe = load_recipe("tiny-cpu")
    text = recipe_yaml(recipe)
    log = TensorBoardLogger(tmp_path)
    log.on_start(text, {"torch": "2.13.0+cpu", "device": "cpu", "recipe_sha256": "ab" * 32})
    losses = [3.25, 2.5, 2.125, float("nan")]
    for step, loss in enumerate(losses, start=1):
        log.on_step(step, {"step": step, "loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3, "tokens": 256,
                           "note": "not a number", "flag": True, "peak_memory_gib": None})
    log.on_end({"status": "completed", "steps_completed": 4, "final_loss": 2.125,
                "window": [2, 3], "tokens_per_s_per_gpu": 1234.5, "timing": {"cv_percent": 1.5}})
    log.close()
    log.close()  # idempotent

    acc = _read(tmp_path / TENSORBOARD_DIR)
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens"} <= tags
    assert not {"train/step", "train/note", "train/flag", "train/peak_memory_gib"} & tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    # values chosen exact in float32 (the event format's precision): compared exactly
    assert [e.value for e in loss[:3]] == losses[:3] and math.isnan(loss[3].value)
    final = acc.Scalars("results/final_loss")
    assert [(e.step, e.value) for e in final] == [(4, 2.125)]
    assert [e.value for e in acc.Scalars("results/timing/cv_percent")] == [1.5]
    assert "results/status" not in tags
    assert "name: tiny-cpu" in _text(acc, "recipe") and "```yaml" in _text(acc, "recipe")
    assert "| torch | 2.13.0+cpu |" in _text(acc, "fingerprint")
    assert "| status | completed |" in _text(acc, "results")


def test_logging_section_defaults_and_sinks(tmp_path):
    recipe = load_recipe("tiny-cpu")
    assert recipe.logging.tensorboard is True and recipe.logging.wandb is None
    sinks = sinks_for(recipe, tmp_path / "run")
    assert [type(s).__name__ for s in sinks] == ["TensorBoardLogger"]
    for s in sinks:
        s.close()
    assert sinks_for(recipe, tmp_path / "other", rank=1) == []
    assert sinks_for(load_recipe("tiny-cpu", ["logging.tensorboard=false"]), tmp_path / "off") == []
    assert not (tmp_path / "off").exists()


def test_wandb_section_has_no_key_field_and_runs_offline_without_a_key(tmp_path):
    r = load_recipe("tiny-cpu", ["logging.wandb.project=muse"])
    assert r.logging.wandb.project == "muse" and r.logging.wandb.mode is None
    assert "api_key" not in recipe_yaml(r)
    with pytest.raises(RecipeError):
        load_recipe("tiny-cpu", ["logging.wandb.project=muse", "logging.wandb.api_key=abc123secret"])
    assert wandb_mode(None, {}) == "offline"
    assert wandb_mode(None, {"WANDB_API_KEY": "x" * 40}) == "online"
    assert wandb_mode("offline", {"WANDB_API_KEY": "x" * 40}) == "offline"


def test_wandb_sink_logs_offline_under_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = load_recipe("tiny-cpu", ["logging.wandb.project=muse", "logging.tensorboard=false"])
    (sink,) = sinks_for(recipe, tmp_path / "run")
    assert sink.mode == "offline"
    sink.on_start(recipe_yaml(recipe), {"torch": "2.13.0"})
    sink.on_step(1, {"loss": 2.5})
    sink.on_end({"final_loss": 2.5})
    sink.close()
    assert any((tmp_path / "run" / "wandb").rglob("*.wandb"))


def test_a_run_writes_its_steps_and_results_to_tensorboard(tmp_path, monkeypatch):
    """The runner calls the logger at start, every step and the end: `tensorboard --logdir RUN/tensorboard`."""
    from muse_stack.run.pipeline import run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = run("tiny-cpu", overrides=["batch.gbs=2", "training.measure_warmup_steps=1"], steps=3,
              out=tmp_path / "tb", progress=False)
    assert out.status == "completed"
    acc = EventAccumulator(str(out.path / TENSORBOARD_DIR))
    acc.Reload()
    losses = [json.loads(line)["loss"] for line in (out.path / "metrics.jsonl").read_text().splitlines()]
    # float32 in the event file: each value within float32 rounding (2^-24 relative) of the float64 metric
    got = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert all(abs(g - w) <= abs(w) * 2**-23 for g, w in zip(got, losses))
    assert acc.Tags()["tensors"] or acc.Tags().get("text", [])  # the recipe and stack summary as text
