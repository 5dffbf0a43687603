"""Checkpoints on a schedule, resume from them, and a run that diverges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse_stack.run import checkpoints
from muse_stack.run.pipeline import run

QUICK = ["training.measure_warmup_steps=1", "batch.gbs=2"]  # two rows a step: quick


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def one_thread_env(monkeypatch, one_thread):
    """The reference engine takes its thread count from OMP_NUM_THREADS: one thread makes
    every reduction order fixed, so two runs' losses agree bit for bit."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_interval_keep_and_final_checkpoint(tmp_path, one_thread_env):
    out = tmp_path / "sched"
    outcome = run("tiny-cpu", out=out, steps=7, progress=False,
                  overrides=[*QUICK, "training.checkpoint_interval=2", "training.keep_checkpoints=2"])
    assert outcome.status == "completed"
    root = out / "checkpoints"
    # saved at 2, 4, 6 and the final 7; the last two kept
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000006", "step-00000007"]
    assert json.loads((root / "latest").read_text()) == {"step": 7, "folder": "step-00000007"}
    final = checkpoints.latest(out)
    assert final is not None and final.step == 7
    assert [r["step"] for r in final.metrics_rows()] == list(range(1, 8))
    assert final.recipe_text() == (out / "recipe.yaml").read_text()
    assert outcome.results["checkpoint"] == {"step": 7, "path": "checkpoints/step-00000007"}
    saves = outcome.results["checkpoint_saves"]
    assert [s["step"] for s in saves] == [2, 4, 6, 7] and not any(s["background"] for s in saves)
    assert all(s["complete_s"] <= s["blocking_s"] for s in saves)  # synchronous: complete before the loop goes on


def test_without_an_interval_a_completed_run_keeps_its_final_checkpoint(tmp_path, one_thread_env):
    out = tmp_path / "final"
    run("tiny-cpu", out=out, steps=3, progress=False, overrides=[*QUICK, "training.checkpoint_interval=null"])
    assert [c.step for c in checkpoints.step_folders(out)] == [3]
    assert (out / "checkpoints" / "step-00000003" / "model.safetensors").is_file()


@pytest.mark.slow
def test_resume_continues_from_latest_bit_for_bit(tmp_path, one_thread_env):
    common = dict(steps=6, progress=False, overrides=[*QUICK, "training.checkpoint_interval=4"])
    full = run("tiny-cpu", out=tmp_path / "full", **common)
    part = run("tiny-cpu", out=tmp_path / "part", stop_after=5, **common)
    assert part.status == "interrupted" and part.results["checkpoint"]["step"] == 5
    done = run(resume=part.path, progress=False)
    assert done.status == "completed" and done.results["resumed_at_step"] == 5
    assert losses(done.path) == losses(full.path)


def test_non_finite_loss_fails_the_run_as_diverged(tmp_path, cli):
    # an infinite learning rate is refused by the schema now; a query scale of 1e30 is a valid recipe
    # whose attention overflows, so the first backward pass gives a NaN gradient norm
    out = tmp_path / "nan"
    rc, text, _ = cli("run", "tiny-cpu", "--steps", "4", "--out", out, "--no-progress",
                      "model.overrides.qk_scale_factor=1e30", *QUICK)
    assert rc == 1 and "diverged" in text and "non-finite" in text
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "diverged" and res["diverged_at_step"] == 1
    assert res["steps_completed"] == 0 and (out / "metrics.jsonl").read_text() == ""
    assert "non-finite gradient norm at step 1" in res["error"]
    assert not (out / "checkpoints" / "latest").exists()  # a diverged state is never checkpointed


def test_async_checkpoint_is_refused_on_the_reference_engine(tmp_path, cli):
    out = tmp_path / "async"
    rc, _, err = cli("run", "tiny-cpu", "training.async_checkpoint=true", "--out", out, "--no-progress")
    assert rc == 2 and "training.async_checkpoint" in err and not out.exists()


def test_a_recipe_that_starts_from_a_user_supplied_checkpoint_refuses_to_start_without_it(tmp_path, cli):
    out = tmp_path / "attune"
    # the record states no clipping or epsilon: given here, so the start checkpoint is what is missing
    # on a GPU machine the start checkpoint is what is missing; on this CPU machine `run` first says
    # the recipe needs the megatron engine, so the refusal itself is checked on the resolved recipe
    from muse_stack.util.errors import RecipeError
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.run.pipeline import _with_start

    with pytest.raises(RecipeError) as e:
        _with_start(load_recipe("attune-b200", []), None)
    err = f"{e.value.field} {e.value.message} {e.value.fix}"
    assert "model.pretrained_checkpoint" in err and "--hf-checkpoint" in err
    assert "--pretrained-checkpoint DIR" in err and not out.exists()


@pytest.mark.slow
def test_the_start_checkpoint_is_recorded_and_a_resume_does_not_reload_it(tmp_path, one_thread_env):
    first = run("tiny-cpu", out=tmp_path / "a", steps=2, progress=False, overrides=QUICK)
    start = checkpoints.latest(first.path).path
    second = run("tiny-cpu", out=tmp_path / "b", steps=4, progress=False, overrides=QUICK,
                 pretrained_checkpoint=str(start), stop_after=3)
    import yaml

    assert yaml.safe_load((second.path / "recipe.yaml").read_text())["model"]["pretrained_checkpoint"] == str(start)
    # the resumed run takes its weights from its own checkpoint, even with the start one gone
    import shutil

    shutil.rmtree(start)
    assert run(resume=second.path, progress=False).status == "completed"


def _free_bytes(monkeypatch, free: int) -> None:
    """The checkpoints' file system reports ``free`` bytes (its total and used are irrelevant)."""
    import shutil as real

    usage = real.disk_usage("/")
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: type(usage)(usage.total, usage.used, free))


def test_a_run_whose_checkpoint_cannot_fit_is_refused_before_it_trains(tmp_path, cli, monkeypatch):
    """tiny-cpu's final checkpoint needs its weights plus AdamW's two moments; with less free space
    the run stops at setup, with the sizes, the field and the fix, and trains no step."""
    _free_bytes(monkeypatch, 1000)
    out = tmp_path / "full-disk"
    rc, text, err = cli("run", "tiny-cpu", "--steps", "3", "--out", out, "--no-progress", *QUICK)
    said = text + err
    assert rc == 4 and "each checkpoint of this run needs about" in said and "MiB free" in said
    assert "checkpoints" in said and "training.final_checkpoint=false" in said
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""
    assert not (out / "checkpoints").exists()


def test_a_throughput_run_without_checkpoints_is_not_asked_for_space(tmp_path, monkeypatch, one_thread_env):
    _free_bytes(monkeypatch, 1000)
    outcome = run("tiny-cpu", out=tmp_path / "nockpt", steps=2, progress=False,
                  overrides=[*QUICK, "training.final_checkpoint=false"])
    assert outcome.status == "completed" and not (outcome.path / "checkpoints").exists()


class _Sized:
    """An engine whose checkpoint is ``size`` bytes and whose save fails like a dead writer process."""

    def __init__(self, size: int) -> None:
        self.size, self.calls = size, 0

    def checkpoint_bytes(self) -> int:
        self.calls += 1
        return self.size

    def save(self, directory, step):
        raise EOFError()


def test_each_save_rechecks_free_space_without_a_new_estimate(tmp_path, monkeypatch):
    engine = _Sized(10 * 2**30)
    manager = checkpoints.CheckpointManager(tmp_path / "run", engine, interval=1, keep=1)
    _free_bytes(monkeypatch, 11 * 2**30)  # 10 GiB x 1.02 fits in 11
    manager.check_space()
    _free_bytes(monkeypatch, 9 * 2**30)
    with pytest.raises(checkpoints.CheckpointError, match=r"step 5 needs about 10\.0 GiB.*9\.0 GiB free") as err:
        manager.save(5, {})
    assert err.value.field == "checkpoints" and engine.calls == 1  # estimated once, at setup
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything was written


def test_a_writer_that_dies_is_a_checkpoint_error_naming_the_free_space(tmp_path, monkeypatch):
    """megatron-core's writer processes report a death (out of space, killed) as an EOFError with
    no message; the run's error names it and what the file system had left."""
    engine = _Sized(2**30)
    manager = checkpoints.CheckpointManager(tmp_path / "run", engine, interval=1, keep=1)
    _free_bytes(monkeypatch, 4 * 2**30)
    manager.check_space()
    with pytest.raises(checkpoints.CheckpointError, match=r"\(EOFError, with 4\.0 GiB free on .* for about 1\.0 GiB\)"):
        manager.save(3, {})
    assert not list((tmp_path / "run" / "checkpoints").glob("*.partial"))  # the partial folder is removed
