"""Fault injection: a run killed (SIGKILL) at any point resumes to the loss curve of a run
never interrupted, bit for bit on one CPU thread; signals during setup and saves; a torn or
short metrics.jsonl; a second writer; a changed recipe; a full disk.

The killed processes are forked from one helper that has already imported torch and
muse-stack (and never ran an OpenMP region, so forking it is safe): each kill then costs a
run's setup, not an interpreter start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from muse_stack.run import checkpoints, faults
from muse_stack.run.dirlock import RunLock
from muse_stack.run.pipeline import run

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
#: a checkpoint every 3 steps, only the newest kept: every save also prunes (two rows a step keep it quick)
OVERRIDES = ["training.measure_warmup_steps=1", "training.checkpoint_interval=3", "training.keep_checkpoints=1",
             "batch.gbs=2"]

ZYGOTE = r"""
import json, os, sys
import torch, torch.optim, torch._dynamo  # the costly imports, once
import muse_stack.cli, muse_stack.run.pipeline, muse_stack.engines.reference, muse_stack.fingerprint, muse_stack.data
from muse_stack.fingerprint import capture, hashing
capture()  # hashes the loaded libraries once; the children inherit the cache
for line in sys.stdin:
    req = json.loads(line)
    if req["cmd"] == "wait":
        _, status = os.waitpid(req["pid"], 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        hashing._pool = None  # the hashing threads stay in the parent: a child starts its own
        os.environ.update(req["env"])
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        from muse_stack.cli import main
        rc = main(req["args"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    print(pid, flush=True)
"""


class Zygote:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.n = 0

    def _ask(self, req: dict) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def start(self, args: list[str], fault: str | None = None) -> tuple[int, Path, Path]:
        self.n += 1
        mark, log = self.workdir / f"mark-{self.n}", self.workdir / f"log-{self.n}"
        env = {"OMP_NUM_THREADS": "1", faults.ENV_MARK: str(mark), faults.ENV_AT: fault or ""}
        pid = self._ask({"cmd": "run", "args": [str(a) for a in args], "env": env, "log": str(log)})
        return pid, mark, log

    def wait(self, pid: int) -> int:
        return self._ask({"cmd": "wait", "pid": pid})

    def kill_at(self, args: list[str], fault: str, timeout: float = 300) -> None:
        """Run until the fault point, then SIGKILL there."""
        pid, mark, log = self.start(args, fault)
        deadline = time.monotonic() + timeout
        while not mark.exists():
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                self.wait(pid)
                pytest.fail(f"never reached {fault}: {log.read_text()[-3000:]}")
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        assert self.wait(pid) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def one_thread_env(monkeypatch, one_thread):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@contextmanager
def _one_thread_module():
    """OMP_NUM_THREADS=1 for a module-scoped run (the reference engine reads it), restored after."""
    import torch

    before = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"], old = "1", os.environ.get("OMP_NUM_THREADS")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce exactly."""
    with _one_thread_module():
        out = run("tiny-cpu", out=tmp_path_factory.mktemp("base") / "run", steps=STEPS, overrides=OVERRIDES,
                  progress=False)
    assert out.status == "completed"
    return losses(out.path)


def test_sigkill_at_every_point_then_resume_reproduces_the_run(tmp_path, baseline, one_thread_env):
    """One run killed at each point in turn, each time resumed by the next command."""
    out = tmp_path / "killed"
    new = ["run", "tiny-cpu", "--steps", STEPS, "--out", out, "--no-progress", *OVERRIDES]
    resume = ["run", "--resume", out, "--no-progress"]
    z = Zygote(tmp_path)
    try:
        z.kill_at(new, "setup")  # the directory exists, nothing else: no results.json
        assert not (out / "results.json").exists()
        z.kill_at(resume, "after-step@2")  # no checkpoint yet: steps 1-2 are redone
        assert steps_of(out) == [1, 2]
        z.kill_at(resume, "save-engine@3")  # inside the save: a partial folder, no latest
        assert (out / "checkpoints" / "step-00000003.partial").is_dir()
        assert checkpoints.latest(out) is None
        z.kill_at(resume, "save-renamed@3")  # step-3 complete, but latest never named it: resumed from, found
        assert (out / "checkpoints" / "step-00000003").is_dir() and not (out / "checkpoints" / "latest").exists()
        assert checkpoints.latest(out).step == 3 and not checkpoints.latest(out).named
        z.kill_at(resume, "save-renamed@6")  # the resume wrote latest (step 3) again; step-6 never named
        assert checkpoints.latest(out).step == 3 and checkpoints.latest(out).named
        assert (out / "checkpoints" / "step-00000006").is_dir()
        z.kill_at(resume, "save-pointed@6")  # latest names step 6; step 3 not yet pruned
        assert checkpoints.latest(out).step == 6 and (out / "checkpoints" / "step-00000003").is_dir()
        z.kill_at(resume, "after-step@7")  # metrics run ahead of the checkpoint
        assert steps_of(out) == list(range(1, 8))
    finally:
        z.close()
    done = run(resume=out, progress=False)
    assert done.status == "completed" and done.results["resumed_at_step"] == 6
    assert steps_of(out) == list(range(1, STEPS + 1))
    assert losses(out) == baseline
    assert [c.step for c in checkpoints.step_folders(out)] == [STEPS]
    assert not any(p.name.endswith(".partial") for p in (out / "checkpoints").iterdir())


def test_sigterm_during_setup_leaves_an_interrupted_run(tmp_path, monkeypatch, one_thread_env, baseline):
    def point(name, step=None):
        if name == "after-data":
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(faults, "point", point)
    out = tmp_path / "setup"
    outcome = run("tiny-cpu", out=out, steps=STEPS, overrides=OVERRIDES, progress=False)
    res = json.loads((out / "results.json").read_text())
    assert outcome.status == res["status"] == "interrupted" and res["steps_completed"] == 0
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run(resume=out, progress=False).status == "completed"
    assert losses(out) == baseline


def test_a_second_signal_during_a_save_does_not_break_it(tmp_path, monkeypatch, one_thread_env, baseline):
    def point(name, step=None):
        if name == "save-engine" and step == 3:  # inside the interval save
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(faults, "point", point)
    out = tmp_path / "twice"
    outcome = run("tiny-cpu", out=out, steps=STEPS, overrides=OVERRIDES, progress=False)
    assert outcome.status == "interrupted" and outcome.results["checkpoint"]["step"] == 3
    assert checkpoints.latest(out).step == 3 and steps_of(out) == [1, 2, 3]
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run(resume=out, progress=False).status == "completed"
    assert losses(out) == baseline


@pytest.fixture(scope="module")
def interrupted_once(tmp_path_factory, baseline):
    out = tmp_path_factory.mktemp("part") / "run"
    with _one_thread_module():
        outcome = run("tiny-cpu", out=out, steps=STEPS, overrides=OVERRIDES, progress=False, stop_after=4)
    assert outcome.status == "interrupted" and checkpoints.latest(out).step == 4
    return out


@pytest.fixture
def interrupted(interrupted_once, tmp_path, one_thread_env):
    """A fresh copy of a run interrupted after step 4 (checkpoint at 4)."""
    out = tmp_path / "part"
    shutil.copytree(interrupted_once, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def test_a_torn_or_short_metrics_file_is_repaired_on_resume(interrupted, baseline):
    """What a full disk or a kill mid-write leaves: rows missing before the checkpoint's step,
    and a torn last line."""
    rows = (interrupted / "metrics.jsonl").read_text().splitlines()
    (interrupted / "metrics.jsonl").write_text("\n".join(rows[:2]) + '\n{"step": 3, "loss": 6.0')
    (interrupted / "results.json").unlink()
    done = run(resume=interrupted, progress=False)
    assert done.status == "completed" and done.results["resumed_at_step"] == 4
    assert steps_of(interrupted) == list(range(1, STEPS + 1)) and losses(interrupted) == baseline
    assert checkpoints.latest(interrupted).step == STEPS


def test_a_second_writer_is_refused(interrupted, cli):
    with RunLock(interrupted):
        rc, _, err = cli("run", "--resume", interrupted, "--no-progress")
    assert rc == 3 and "being written by another process" in err and f"pid {os.getpid()}" in err
    assert steps_of(interrupted) == [1, 2, 3, 4]


def test_resume_refuses_changes_naming_each_field(interrupted, cli):
    text = (interrupted / "recipe.yaml").read_text()
    (interrupted / "recipe.yaml").write_text(text.replace("lr: 0.01", "lr: 0.02"))
    rc, _, err = cli("run", "--resume", interrupted, "--steps", "9", "batch.gbs=16", "--no-progress")
    assert rc == 3
    for field in ("optimizer.lr: 0.01 -> 0.02", "training.steps: 8 -> 9", "batch.gbs: 2 -> 16", "--allow-change"):
        assert field in err, err
    assert steps_of(interrupted) == [1, 2, 3, 4]


def test_allow_change_records_the_change(interrupted, interrupted_once, cli):
    from muse_stack.recipes.catalogue import parse_recipe, recipe_sha256
    import yaml

    before = json.loads((interrupted / "fingerprint.json").read_text())["run_inputs"]["recipe_sha256"]
    rc, _, err = cli("run", "--resume", interrupted, "--steps", "10", "--allow-change", "--no-progress")
    assert rc == 0, err
    recipe = parse_recipe(yaml.safe_load((interrupted / "recipe.yaml").read_text()), "recipe.yaml")
    assert recipe.training.steps == 10
    inputs = json.loads((interrupted / "fingerprint.json").read_text())["run_inputs"]
    assert inputs["recipe_sha256"] == recipe_sha256(recipe) != before
    change = inputs["changes"][0]
    assert change["at_step"] == 4 and change["fields"] == {"training.steps": [8, 10]}
    assert change["recipe_sha256_before"] == before
    assert json.loads((interrupted / "results.json").read_text())["changes"] == inputs["changes"]
    assert steps_of(interrupted) == list(range(1, 11))
    # diff against the run it was copied from shows the change: the recipe hash and the changes entry
    rc, text, _ = cli("diff", interrupted_once, interrupted, "--json")
    paths = {d["path"] for d in json.loads(text)["differences"]}
    assert rc == 2 and {"run_inputs.recipe_sha256", "run_inputs.changes", "recipe.training.steps"} <= paths, paths


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: the disk-full case needs a small tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the disk-full case ({done.stderr.strip() or done.returncode})")


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path, one_thread_env, baseline, cli):
    disk = tmp_path / "disk"
    # one tiny-cpu checkpoint is 3.0 MB (1.0 MB of fp32 weights, 2.0 MB of Adam's two moments);
    # 4.5 MB holds the run's small files and the first save, not a second one beside it
    _mount_tmpfs(disk, "4500k")
    try:
        out = disk / "run"
        rc, _, err = cli("run", "tiny-cpu", "--steps", STEPS, "--out", out, "--no-progress", *OVERRIDES)
        # the free-space check refuses the next save before writing: the estimate (2.9 MiB) is that 3.0 MB
        assert rc == 4 and "the checkpoint at step 6 needs about 2.9 MiB" in err and "intact (step 3)" in err, err
        res = json.loads((out / "results.json").read_text())
        assert res["status"] == "failed" and res["checkpoint"]["step"] == 3
        assert checkpoints.latest(out).step == 3
        assert not any(p.name.endswith(".partial") for p in (out / "checkpoints").iterdir())
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert run(resume=out, progress=False).status == "completed"
        assert losses(out) == baseline
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_resume_refuses_another_process_count(interrupted, cli, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would launch it, RANK 0
    monkeypatch.setenv("RANK", "0")
    rc, _, err = cli("run", "--resume", interrupted, "--no-progress")
    assert rc == 2 and "hardware.count" in err and "--allow-change" in err
    assert steps_of(interrupted) == [1, 2, 3, 4]
