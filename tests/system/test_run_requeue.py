"""Resume on requeue: `run RECIPE --out DIR --resume auto` is the one command of every attempt of
a cluster job. A crashed, killed or interrupted run with a checkpoint resumes; a run without one
restarts cleanly in the same folder; a refused command leaves the folder as it was; `--dry-run`
writes nothing; `--json` prints the summary as one document."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muse_stack.run import checkpoints, faults
from muse_stack.run.pipeline import run

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
#: two rows a step and a checkpoint every 3 steps: quick, and a crash at step 5 loses steps 4-5
OVERRIDES = ["training.measure_warmup_steps=1", "training.checkpoint_interval=3", "batch.gbs=2"]
RUN_FILES = ("recipe.yaml", "results.json", "fingerprint.json", "metrics.jsonl")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, one_thread):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def auto(out: Path, **kw):
    return run("tiny-cpu", out=out, steps=STEPS, overrides=OVERRIDES, resume="auto", progress=False, **kw)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under the run directory (the lock file aside) and its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def tensorboard_steps(path: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path / "tensorboard"))  # purges orphaned events, as TensorBoard's UI does
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The losses of the same run, never interrupted (one CPU thread: equal bit for bit)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = run("tiny-cpu", out=tmp_path_factory.mktemp("base") / "run", steps=STEPS, overrides=OVERRIDES,
                  progress=False)
    finally:
        torch.set_num_threads(before)
    assert out.status == "completed"
    return [r["loss"] for r in rows(out.path)]


def crash_at(monkeypatch, step: int) -> None:
    """The run raises inside step ``step`` (a crash the process reports: results.json says failed)."""
    from muse_stack.run.steps import TrainSteps

    real = TrainSteps.step

    def train_step(self, n):
        if n == step:
            raise RuntimeError(f"simulated crash at step {n}")
        return real(self, n)

    monkeypatch.setattr(TrainSteps, "step", train_step)


def test_a_crashed_run_resumes_under_auto_with_every_step_once(tmp_path, monkeypatch, baseline):
    out = tmp_path / "job"
    crash_at(monkeypatch, 6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        auto(out)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "failed" and res["checkpoint"]["step"] == 3 and len(rows(out)) == 5
    assert tensorboard_steps(out) == [1, 2, 3, 4, 5]  # flushed at the end of the failed attempt
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stdout = io.StringIO()
    done = auto(out, step_stream=stdout)  # the requeued job: the same command
    assert done.status == "completed" and done.results["resumed_at_step"] == 3
    assert stdout.getvalue().splitlines()[0] == "resumed at step 3"  # the job's log says so, not only run.log
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows(out)] == baseline
    # steps 4 and 5 were logged by the crashed attempt and again after the resume: shown once
    assert tensorboard_steps(out) == list(range(1, STEPS + 1))
    fresh = io.StringIO()
    auto(tmp_path / "fresh", step_stream=fresh)  # a run from its start says nothing of resuming
    assert "resumed" not in fresh.getvalue() and fresh.getvalue().startswith("step ")
    again = auto(out)  # a requeue after the end changes nothing
    assert again.status == "completed" and again.results["steps_completed"] == STEPS


def test_a_sigkilled_job_resumes_when_requeued(tmp_path, baseline):
    """SIGKILL (an OOM kill, `scancel -s KILL`, a lost node) after step 5: no results.json at all."""
    out, mark = tmp_path / "killed", tmp_path / "mark"
    cmd = [sys.executable, "-m", "muse_stack.cli", "run", "tiny-cpu", "--out", str(out), "--resume", "auto",
           "--steps", str(STEPS), "--no-progress", *OVERRIDES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", faults.ENV_AT: "after-step@5", faults.ENV_MARK: str(mark)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not mark.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"never reached step 5: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (out / "results.json").exists() and checkpoints.latest(out).step == 3
    done = auto(out)
    assert done.status == "completed" and done.results["resumed_at_step"] == 3
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows(out)] == baseline


def test_a_run_without_a_checkpoint_restarts_cleanly(tmp_path, monkeypatch, baseline):
    out = tmp_path / "early"
    crash_at(monkeypatch, 2)  # before the first checkpoint (step 3)
    with pytest.raises(RuntimeError):
        auto(out)
    assert checkpoints.latest(out) is None and len(rows(out)) == 1
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    done = auto(out)
    assert done.status == "completed" and "resumed_at_step" not in done.results
    assert [r["loss"] for r in rows(out)] == baseline
    assert tensorboard_steps(out) == list(range(1, STEPS + 1))
    assert "simulated crash" in (out / "run.log").read_text()  # the earlier attempt's lines are kept


def test_a_refused_resume_leaves_the_run_directory_unchanged(tmp_path, monkeypatch, cli):
    out = tmp_path / "refused"
    assert run("tiny-cpu", out=out, steps=STEPS, overrides=OVERRIDES, stop_after=4, progress=False).status \
        == "interrupted"
    before = snapshot(out)
    # a change the command line refuses
    rc, _, err = cli("run", "--resume", out, "--steps", "10", "--no-progress")
    assert rc == 3 and "training.steps" in err
    assert snapshot(out) == before
    # an accepted change whose resume is refused at setup (no room for the next checkpoint)
    import shutil

    from muse_stack.run.checkpoints import CheckpointError

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1))
    with pytest.raises(CheckpointError):
        run(resume=out, steps=10, allow_change=True, progress=False)
    after = snapshot(out)
    assert {k: after[k] for k in RUN_FILES} == {k: before[k] for k in RUN_FILES}
    assert json.loads((out / "results.json").read_text())["status"] == "interrupted"
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert auto(out).status == "completed"  # the requeue still resumes it


def test_bad_inputs_are_refused_before_the_run_directory_exists(tmp_path, monkeypatch, cli):
    out = tmp_path / "bad"
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--pretrained-checkpoint", tmp_path / "nowhere",
                     "--no-progress", "--steps", "2")
    assert rc == 3 and "--pretrained-checkpoint" in err and not out.exists()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "logging.wandb.project=muse", "--no-progress", "--steps", "2")
    assert rc == 2 and "wandb is not installed" in err and "logging.wandb" in err and not out.exists()
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--resume", "auto", "logging.wandb.project=muse",
                     "--no-progress", "--steps", "2")
    assert rc == 2 and not out.exists()


def test_a_run_that_failed_before_its_first_step_does_not_block_the_corrected_command(tmp_path, cli):
    out = tmp_path / "fixme"
    rc, _, _ = cli("run", "tiny-cpu", "--out", out, "--no-progress", "--steps", "2",
                   f"data.files=[{tmp_path / 'missing.jsonl'}]")
    assert rc != 0 and json.loads((out / "results.json").read_text())["status"] == "failed"
    rc, text, err = cli("run", "tiny-cpu", "--out", out, "--no-progress", "--steps", "2",
                        "training.measure_warmup_steps=1")
    assert rc == 0, err
    assert json.loads((out / "results.json").read_text())["status"] == "completed" and len(rows(out)) == 2


def test_auto_refuses_what_it_must_not_touch(tmp_path, cli):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    rc, _, err = cli("run", "tiny-cpu", "--out", other, "--resume", "auto", "--no-progress")
    assert rc == 3 and "not a run directory" in err and (other / "notes.txt").read_text() == "mine"
    rc, _, err = cli("run", "tiny-cpu", "--resume", "auto", "--no-progress")
    assert rc == 2 and "--out" in err
    empty = tmp_path / "empty"  # a job's pre-made output folder
    empty.mkdir()
    rc, _, err = cli("run", "tiny-cpu", "--out", empty, "--resume", "auto", "--no-progress", "--steps", "2",
                     "training.measure_warmup_steps=1")
    assert rc == 0, err
    assert json.loads((empty / "results.json").read_text())["status"] == "completed"


def test_a_diverged_run_is_not_resumed_by_auto(tmp_path, cli):
    out = tmp_path / "div"
    # a query scale of 1e30 overflows the attention: the first backward gives a NaN gradient norm
    args = ["run", "tiny-cpu", "--out", out, "--resume", "auto", "--no-progress", "--steps", "4",
            "model.overrides.qk_scale_factor=1e30", "batch.gbs=2"]
    rc, _, _ = cli(*args)
    res = json.loads((out / "results.json").read_text())
    assert rc == 1 and res["status"] == "diverged"
    before = snapshot(out)
    rc, _, err = cli(*args)
    assert rc == 3 and "diverged" in err and "--allow-change" in err
    assert snapshot(out) == before


def test_dry_run_checks_everything_and_writes_nothing(tmp_path, cli):
    out = tmp_path / "dry"
    rc, text, err = cli("run", "tiny-cpu", "--out", out, "--dry-run", "--no-progress")
    assert rc == 0 and "would start a new run" in text and not out.exists()
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--dry-run", "layout.tp=3")
    assert rc == 2 and "layout.tp" in err and not out.exists()
    assert run("tiny-cpu", out=out, steps=STEPS, overrides=OVERRIDES, stop_after=3, progress=False).status \
        == "interrupted"
    before = snapshot(out)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    rc, text, err = cli("run", "tiny-cpu", "--out", out, "--resume", "auto", "--dry-run", "--steps", STEPS,
                        *OVERRIDES)
    assert rc == 0 and "would resume" in text and "from step 3" in text, err
    rc, text, _ = cli("run", "--resume", out, "--dry-run", "--json")
    doc = json.loads(text)
    assert rc == 0 and doc["status"] == "dry-run" and doc["action"] == "resume" and doc["from_step"] == 3
    assert snapshot(out) == before and {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps


def test_json_summary_is_one_document_for_scripts(tmp_path, cli):
    out = tmp_path / "js"
    rc, text, err = cli("run", "tiny-cpu", "--out", out, "--no-progress", "--json", "--steps", "3",
                        "training.measure_warmup_steps=1")
    assert rc == 0, err
    doc = json.loads(text)  # stdout holds exactly the summary: the step lines went to stderr
    assert doc == {"status": "completed", "run_dir": str(out), **json.loads((out / "results.json").read_text())}
    assert "step 3/3" in err
