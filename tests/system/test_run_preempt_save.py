"""A preempted job whose checkpoint save takes longer than torchrun's own grace, at full scale in time.

torchrun passes SIGTERM to its workers and SIGKILLs them ``--shutdown-timeout`` seconds later (30 s unless given:
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``'s default, read from torch below). A full-size rank's planned save takes longer
(muse_stack/plan/save.py: sft-192's 64.8 GB at the measured 0.569 GB/s, 114 s), so every node's command passes
torchrun the warning signal's lead as its grace (:meth:`muse_stack.launch.spec.LaunchSpec.torchrun_options`: one step
plus twice the planned save, at least 120 s).

Here tiny-cpu runs under that command, word for word as the launcher writes it for a node
(:meth:`~muse_stack.launch.spec.LaunchSpec.node_command`, the Kubernetes pod's command; only the Python is this
one), and its save is made to take ``SAVE_S`` seconds, longer than torchrun's default grace
(``MUSE_STACK_FAULT_SLOW_SAVE_S``, the fault-injection sleep inside the save before its folder is complete). SIGTERM
goes to torchrun, as Kubernetes sends it to the pod's process and srun passes the batch script's warning to each
node's task. With the launcher's grace the save completes and the requeue (the same command) continues with every
step once and the losses of an uninterrupted run, bit for bit. With torchrun's default grace the same save is
killed, and the periodic checkpoint bounds the loss to one interval.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muse_stack.launch.spec import resolve
from muse_stack.run.faults import ENV_SLOW_SAVE
from muse_stack.run.pipeline import run

ROOT = Path(__file__).resolve().parents[2]
GRACE_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  #: torchrun's grace where --shutdown-timeout is not given


def _torchrun_default_grace() -> int:
    """The grace torchrun gives its workers without --shutdown-timeout, as torch sets it (launcher/api.py)."""
    from torch.distributed.launcher.api import LaunchConfig

    saved = os.environ.pop(GRACE_ENV, None)
    try:
        return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout
    finally:
        if saved is not None:
            os.environ[GRACE_ENV] = saved


DEFAULT_GRACE = _torchrun_default_grace()
#: longer than the default grace: torchrun's SIGKILL comes DEFAULT_GRACE s after the signal, and the save cannot end
#: sooner than SAVE_S s after it (it starts once the step under way is done); 5 s more keeps the kill certain
SAVE_S = DEFAULT_GRACE + 5
STEPS = 12
#: periodic saves: a save cut short loses at most the steps since the last one
INTERVAL = 6
OVERRIDES = ["training.measure_warmup_steps=1", f"training.checkpoint_interval={INTERVAL}",
             "training.keep_checkpoints=2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def _latest(out: Path) -> int:
    return json.loads((out / "checkpoints" / "latest").read_text())["step"]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_what_is_left():
    """A failed assertion leaves no torchrun running: each one started here is killed, with its workers."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _node(out: Path, log: Path, *, slow_save: bool, grace: bool = True) -> subprocess.Popen:
    """One node of the launched job: the launcher's command for it, with or without its --shutdown-timeout."""
    spec = resolve("tiny-cpu", OVERRIDES, steps=STEPS, run_name="preempt")
    assert spec.signal_s > SAVE_S > DEFAULT_GRACE  # the launcher's grace covers the save; torchrun's own does not
    cmd = spec.node_command("1", f"127.0.0.1:{_port()}", out.name, str(out), python=sys.executable)
    if not grace:
        kept = [w for w in cmd if not w.startswith("--shutdown-timeout=")]
        assert len(kept) == len(cmd) - 1
        cmd = kept
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", GRACE_ENV, ENV_SLOW_SAVE):
        env.pop(name, None)
    if slow_save:
        env[ENV_SLOW_SAVE] = str(SAVE_S)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    STARTED.append(proc)
    return proc


def _wait(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("torchrun did not stop: " + log.read_text()[-3000:]) from None


def _term_after(proc: subprocess.Popen, out: Path, log: Path, rows: int) -> None:
    """SIGTERM to torchrun once the run has ``rows`` metrics rows."""
    deadline = time.time() + 120
    while time.time() < deadline and len(_rows(out)) < rows and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and len(_rows(out)) >= rows, log.read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)


def test_the_launchers_grace_lets_a_save_longer_than_torchruns_own_finish(tmp_path):
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "run"
    attempt = _node(out, tmp_path / "attempt.log", slow_save=True)
    _term_after(attempt, out, tmp_path / "attempt.log", 2)
    ref = _node(ref_out, tmp_path / "uninterrupted.log", slow_save=False)  # trains while the attempt saves
    _wait(attempt, tmp_path / "attempt.log", SAVE_S + 90)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "interrupted", (tmp_path / "attempt.log").read_text()[-3000:]
    done = res["steps_completed"]
    save = res["checkpoint_saves"][-1]
    # the save outlived torchrun's own grace
    assert save["step"] == done and save["complete_s"] >= SAVE_S > DEFAULT_GRACE
    assert _latest(out) == done and len(_rows(out)) == done  # it finished: nothing trained is lost
    before = _rows(out)

    requeue = _node(out, tmp_path / "requeue.log", slow_save=False)  # the job's one command, again
    assert _wait(requeue, tmp_path / "requeue.log", 240) == 0, (tmp_path / "requeue.log").read_text()[-3000:]
    assert _wait(ref, tmp_path / "uninterrupted.log", 240) == 0, (tmp_path / "uninterrupted.log").read_text()[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and res["resumed_at_step"] == done
    assert f"resumed at step {done}" in (tmp_path / "requeue.log").read_text()  # the job's log says so
    after, uninterrupted = _rows(out), _rows(ref_out)
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))  # every step once
    assert after[:done] == before
    # one process with one thread on both sides, the same data order and state restored: the same bits
    assert [(r["loss"], r["grad_norm"]) for r in after] == [(r["loss"], r["grad_norm"]) for r in uninterrupted]


def test_torchruns_own_grace_kills_the_same_save_and_the_interval_bounds_the_loss(tmp_path):
    out = tmp_path / "run"
    # an earlier attempt of the job saved its periodic checkpoint at INTERVAL
    first = run("tiny-cpu", overrides=OVERRIDES, steps=STEPS, out=out, stop_after=INTERVAL, progress=False)
    assert first.results["steps_completed"] == INTERVAL and _latest(out) == INTERVAL
    log = tmp_path / "attempt.log"
    attempt = _node(out, log, slow_save=True, grace=False)
    _term_after(attempt, out, log, INTERVAL + 1)
    _wait(attempt, log, DEFAULT_GRACE + 90)
    done = len(_rows(out))
    assert done > INTERVAL and _latest(out) == INTERVAL, log.read_text()[-3000:]  # the signal's save was killed
    assert "interrupted (SIGTERM)" not in (out / "run.log").read_text()  # the run never got past the save
    assert done - _latest(out) <= INTERVAL  # at most one interval lost

    resumed = run(resume=out, progress=False)
    assert resumed.results["resumed_at_step"] == INTERVAL and resumed.results["status"] == "completed"
    assert [r["step"] for r in _rows(out)] == list(range(1, STEPS + 1))  # every step once
