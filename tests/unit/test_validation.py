"""Validation (recipe ``validation``): the held-out split, the fill from Megatron-Bridge's common
recipes, the validation loss of a run on stdout, metrics.jsonl and TensorBoard, its value, and a
resume that records each validation once."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from muse_stack.data import build_for_recipe
from muse_stack.data.split import split_for_recipe
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.run.pipeline import run

VALIDATE = ["validation.eval_interval=2", "validation.eval_iters=2"]
STEPS = 5  #: validation after steps 2 and 4 (the interval) and 5 (the end of the run)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def val_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "val_loss" in r]


def tensorboard_val(path: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("val/loss")] if "val/loss" in acc.Tags()["scalars"] else []


# -- the recipe: Bridge's keys and its common-recipe defaults -------------------------------
def test_a_recipe_without_validation_has_none_and_fills_none():
    recipe = load_recipe("tiny-cpu")
    assert recipe.validation is None
    assert not [p for p in recipe.filled if p.startswith("validation.")]


@pytest.mark.parametrize("override, task, interval, function", [
    ([], "sft", 100, "_sft_common"),
    (["task=pretrain"], "pretrain", 500, "_pretrain_common"),
])
def test_a_stated_section_is_filled_from_bridges_common_recipe(override, task, interval, function):
    recipe = load_recipe("tiny-cpu", ["validation={}", *override])
    assert recipe.task == task
    assert (recipe.validation.eval_interval, recipe.validation.eval_iters) == (interval, 32)
    for field in ("eval_interval", "eval_iters"):
        source = recipe.filled[f"validation.{field}"].source
        assert f"megatron.bridge.recipes.common.{function}" in source and "0.6.2" in source


def test_bridge_keys_map_and_a_stated_value_wins():
    recipe = load_recipe("tiny-cpu", ["validation.eval_iters=4", "train.eval_interval=3"])
    assert (recipe.validation.eval_interval, recipe.validation.eval_iters) == (3, 4)
    assert "validation.eval_interval" not in recipe.filled and "validation.eval_iters" not in recipe.filled
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny-cpu", ["validation.skip_train=true"])
    assert "validation.eval_interval" in err.value.render() or "validation.eval_iters" in err.value.render()


def test_without_a_fill_policy_an_unstated_value_is_refused_naming_it(tmp_path):
    overrides = ["fill_policy=none", "validation.eval_iters=2"] + [
        f"optimizer.{k}={v}" for k, v in (("lr", 1e-3), ("min_lr", 0.0), ("warmup_steps", 1), ("decay_style", "cosine"),
                                           ("weight_decay", 0.0), ("clip_grad", 1.0), ("beta1", 0.9),
                                           ("beta2", 0.95), ("eps", 1e-8))]
    recipe = load_recipe("tiny-cpu", overrides)
    assert recipe.validation.eval_interval is None
    with pytest.raises(RecipeError) as err:
        split_for_recipe(recipe, object())
    assert err.value.field == "validation.eval_interval"
    with pytest.raises(RecipeError) as err:  # refused before the run writes anything
        run("tiny-cpu", out=tmp_path / "run", overrides=overrides, progress=False)
    assert err.value.field == "validation.eval_interval" and not (tmp_path / "run").exists()


# -- the held-out split ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def built():
    return build_for_recipe(load_recipe("tiny-cpu"), progress=False)


def test_without_validation_the_training_rows_are_the_build(built):
    data, held = split_for_recipe(load_recipe("tiny-cpu"), built)
    assert held is None and data is built


def test_the_held_out_rows_are_not_training_rows(built):
    recipe = load_recipe("tiny-cpu", VALIDATE)
    data, held = split_for_recipe(recipe, built)
    rows = built.rows()
    assert held.num_rows == 2 * recipe.batch.gbs
    assert data.num_rows + held.num_rows == rows.num_rows
    assert data.rows_sha256 != built.rows_sha256 and held.rows_sha256 not in (data.rows_sha256, built.rows_sha256)
    train_ids = {data.rows().ids[i].tobytes() for i in range(data.num_rows)}
    held_ids = {held.rows.ids[i].tobytes() for i in range(held.num_rows)}
    assert len(train_ids) + len(held_ids) == rows.num_rows  # every packed row is distinct: the check below can fail
    assert not train_ids & held_ids
    # the same build always holds out the same rows
    again = split_for_recipe(recipe, build_for_recipe(recipe, progress=False))[1]
    assert np.array_equal(again.index, held.index) and again.rows_sha256 == held.rows_sha256


def test_holding_out_too_much_is_refused_naming_eval_iters(built):
    recipe = load_recipe("tiny-cpu", ["validation.eval_interval=2", "validation.eval_iters=1000"])
    with pytest.raises(RecipeError) as err:
        split_for_recipe(recipe, built)
    assert err.value.field == "validation.eval_iters" and "lower validation.eval_iters" in err.value.render()


# -- a run -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """tiny-cpu, 5 steps, validation every 2 steps over 2 batches; every row each collation
    reads, by the rows object it reads from."""
    from muse_stack.data import batches

    out = tmp_path_factory.mktemp("val") / "run"
    stream = io.StringIO()
    seen: list[tuple[int, bytes]] = []
    collate = batches.collate

    def spy(rows, index):
        seen.extend((id(rows), rows.ids[int(i)].tobytes()) for i in index)
        return collate(rows, index)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches, "collate", spy)
        outcome = run("tiny-cpu", out=out, steps=STEPS, overrides=VALIDATE, progress=False, step_stream=stream)
    return outcome, stream.getvalue(), seen


def test_val_loss_at_the_interval_and_the_end_in_metrics_stdout_and_tensorboard(validated):
    outcome, stdout, _ = validated
    assert outcome.status == "completed"
    rows = metrics(outcome.path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one row per step, as before
    assert val_steps(rows) == [2, 4, 5]
    losses = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert all(math.isfinite(v) and v > 0 for v in losses.values())
    lines = [line for line in stdout.splitlines() if "val_loss" in line]
    assert [line.split()[1] for line in lines] == [f"{s}/{STEPS}" for s in (2, 4, 5)]
    for line in lines:
        step = int(line.split()[1].split("/")[0])
        assert f"val_loss {losses[step]:.4f}" in line
    tb = tensorboard_val(outcome.path)
    assert [s for s, _ in tb] == [2, 4, 5]
    assert [v for _, v in tb] == pytest.approx([losses[s] for s in (2, 4, 5)], rel=1e-6)  # float32 events
    results = json.loads((outcome.path / "results.json").read_text())
    assert results["validation"]["evaluations"] == 3 and results["validation"]["val_loss"] == losses[5]
    fp = json.loads((outcome.path / "fingerprint.json").read_text())
    assert fp["extra"]["validation"]["rows_sha256"] == results["validation"]["rows_sha256"]


def test_held_out_rows_never_reach_a_training_batch(validated, built):
    outcome, _, seen = validated
    recipe = load_recipe("tiny-cpu", VALIDATE)
    held = split_for_recipe(recipe, built)[1]
    held_ids = {held.rows.ids[i].tobytes() for i in range(held.num_rows)}
    by_source: dict[int, list[bytes]] = {}
    for source, row in seen:
        by_source.setdefault(source, []).append(row)
    validation = [rows for rows in by_source.values() if set(rows) <= held_ids]
    training = [rows for rows in by_source.values() if not set(rows) <= held_ids]
    assert len(validation) == 1 and len(validation[0]) == 3 * held.num_rows  # 3 evaluations, all held-out rows
    assert len(training) == 1 and len(training[0]) == STEPS * recipe.batch.gbs
    assert not set(training[0]) & held_ids


def test_val_loss_is_the_checkpointed_models_loss_on_the_held_out_batches(validated, built):
    from muse_stack.models.muse_spark import load_checkpoint

    outcome, _, _ = validated
    recipe = load_recipe("tiny-cpu", VALIDATE)
    held = split_for_recipe(recipe, built)[1]
    model = load_checkpoint(outcome.path / "checkpoints" / f"step-{STEPS:08d}").eval()
    total = count = 0.0
    with torch.no_grad():
        for mb in held.batches(1):  # one row at a time: the loss is a per-token mean whatever the batching
            out = model(mb["input_ids"], position_ids=mb["position_ids"], segment_ids=mb["segment_ids"],
                        labels=mb["labels"], loss_mask=mb["loss_mask"])
            total += float(out.loss) * float(out.num_tokens)
            count += float(out.num_tokens)
    recorded = metrics(outcome.path)[-1]
    assert recorded["val_supervised_tokens"] == count
    # the same float32 weights (safetensors keep them bit for bit) through the same operations on the
    # same rows; only the rows per micro-batch (the run's batch.mbs) and the threads of the float32
    # matmuls may change the order of a sum, about 1e-7 relative per operation: 1e-5 bounds it
    assert recorded["val_loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.slow
def test_a_resume_records_each_validation_once(tmp_path, validated):
    """A run that dies after step 4 (its validation logged) with its checkpoint at step 3 resumes
    there: steps 4-5 and their validations are recorded once, equal to the uninterrupted run's."""
    from muse_stack.run import faults

    class Crash(BaseException):
        pass

    point = faults.point

    def crash_after_step_4(name, step=None):
        if name == "after-step" and step == 4:
            raise Crash()
        point(name, step)

    out = tmp_path / "run"
    common = ["training.checkpoint_interval=3", *VALIDATE]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(faults, "point", crash_after_step_4)
        with pytest.raises(Crash):
            run("tiny-cpu", out=out, steps=STEPS, overrides=common, progress=False, step_stream=io.StringIO())
    assert val_steps(metrics(out)) == [2, 4] and [s for s, _ in tensorboard_val(out)] == [2, 4]
    stream = io.StringIO()
    done = run(resume=out, progress=False, step_stream=stream)
    assert done.status == "completed" and done.results["resumed_at_step"] == 3
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and val_steps(rows) == [2, 4, 5]
    assert [s for s, _ in tensorboard_val(out)] == [2, 4, 5]
    assert [line.split()[1] for line in stream.getvalue().splitlines() if "val_loss" in line] == ["4/5", "5/5"]
    full = metrics(validated[0].path)
    # the resumed steps repeat the uninterrupted run's float32 operations from state saved bit for bit
    assert [r.get("val_loss") for r in rows] == [r.get("val_loss") for r in full]


# -- compare: the validation curves --------------------------------------------------------
def _run_dir(path: Path, val: dict[int, float | None], steps: int = 20) -> Path:
    path.mkdir(parents=True)
    lines = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 4.0 - 0.1 * s, "grad_norm": 1.0}
        if s in val:
            row["val_loss"] = val[s]
        lines.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


GOLDEN_VAL = {s: 4.2 - 0.1 * s for s in range(4, 21, 4)}


def test_compare_judges_the_validation_curves_only_when_asked(tmp_path, cli):
    golden = _run_dir(tmp_path / "golden", GOLDEN_VAL)
    # the same training curve; the held-out loss stalls from step 12 on
    worse = _run_dir(tmp_path / "worse", {s: v if s < 12 else GOLDEN_VAL[8] for s, v in GOLDEN_VAL.items()})
    rc, out, _ = cli("compare", golden, worse, "--json", "--no-plot")
    assert rc == 0 and "validation" not in json.loads(out)
    rc, out, _ = cli("compare", golden, worse, "--json", "--no-plot", "--validation")
    report = json.loads(out)
    assert rc == 1 and report["convergence"]["passed"] and not report["validation"]["passed"]
    assert "final loss" in report["validation"]["failed_checks"]
    assert report["validation"]["points_compared"] == len(GOLDEN_VAL)
    same = _run_dir(tmp_path / "same", GOLDEN_VAL)
    rc, out, _ = cli("compare", golden, same, "--json", "--no-plot", "--validation")
    assert rc == 0 and json.loads(out)["validation"]["passed"]
    rc, out, _ = cli("compare", golden, same, "--validation")  # the table, and the plot with both curves
    assert rc == 0 and "validation (5 points compared" in out and (same / "compare-golden.png").is_file()


def test_validation_curves_must_exist_at_the_same_steps_and_be_finite(tmp_path):
    from muse_stack.compare.convergence import check_validation
    from muse_stack.compare.runs import read_metrics

    golden = read_metrics(_run_dir(tmp_path / "golden", GOLDEN_VAL))
    none = check_validation(golden, read_metrics(_run_dir(tmp_path / "none", {})))
    assert none.failed == ["validation recorded"] and "candidate records no val_loss" in none.checks[0].detail
    shifted = check_validation(golden, read_metrics(_run_dir(tmp_path / "shifted", {s + 1: v for s, v in
                                                                                      GOLDEN_VAL.items()})))
    assert "same validation steps" in shifted.failed
    broken = {**GOLDEN_VAL, 8: None}
    nan = check_validation(golden, read_metrics(_run_dir(tmp_path / "nan", broken)))
    assert "finite validation loss" in nan.failed and "at steps 8" in nan.checks[2].detail


@pytest.mark.parametrize("collect", [True, False])
def test_manual_gc_collects_around_each_validation(tmp_path, monkeypatch, collect):
    """With training.gc.eval (Bridge's manual_gc_eval) a full collection right before each
    validation and a young-generation one right after it; without it, none (the collector is off)."""
    import gc

    from muse_stack.run.steps import TrainSteps
    from muse_stack.run.trainer import Trainer

    events: list[tuple] = []
    state = {"training": False}
    real_eval, real_step, real_finish = TrainSteps.evaluate, TrainSteps.step, Trainer.finish

    def evaluate(self, held):
        events.append(("validate",))
        return real_eval(self, held)

    def train_step(self, n):
        state["training"] = True
        events.append(("step", n))
        return real_step(self, n)

    def finish(self):
        state["training"] = False
        return real_finish(self)

    def callback(phase, info):
        if phase == "start" and state["training"]:
            events.append(("gc", info["generation"]))

    monkeypatch.setattr(TrainSteps, "evaluate", evaluate)
    monkeypatch.setattr(TrainSteps, "step", train_step)
    monkeypatch.setattr(Trainer, "finish", finish)
    gc.callbacks.append(callback)
    try:
        out = run("tiny-cpu", out=tmp_path / "gc", steps=3, progress=False,
                  overrides=[*VALIDATE, f"training.gc.eval={str(collect).lower()}", "training.final_checkpoint=false"])
    finally:
        gc.callbacks.remove(callback)
    assert out.status == "completed"
    around = [("gc", 2), ("validate",), ("gc", 0)] if collect else [("validate",)]
    assert events == [("step", 1), ("step", 2), *around, ("step", 3), *around]
