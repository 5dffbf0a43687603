"""A checkpoint save slower than torchrun's grace, cut short or not by the grace the launcher sets.

torchrun passes SIGTERM to its workers and SIGKILLs them ``--shutdown-timeout`` seconds later (30 s unless
given). The planned save of a full-size rank takes longer (muse_stack/plan/save.py: sft-192's 64.8 GB at the
measured 0.569 GB/s, 114 s), so the launcher passes torchrun the warning signal's lead as its grace: one step plus
``SIGNAL_MARGIN`` planned saves (:func:`muse_stack.plan.save.signal_seconds`).

Scaled down: tiny-cpu's save is made to take ``SAVE_S`` = 3 s (``MUSE_STACK_FAULT_SLOW_SAVE_S``, a sleep inside
the save before its folder is complete) and the grace torchrun would give without the launcher stands at 1 s, the
same order as the full-size case (30 s against 114 s: a grace about a quarter of the save; here a third). The
launcher's grace comes from the same function with the planned save set to ``SAVE_S``; only the 120 s floor, a
wall-clock allowance for full-size setup, is left out (``floor=0``), so the test keeps to seconds.
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

from muse_stack.plan.save import signal_seconds
from muse_stack.run.faults import ENV_SLOW_SAVE
from muse_stack.run.pipeline import run

ROOT = Path(__file__).resolve().parents[2]
SAVE_S = 3.0
TORCHRUN_GRACE_S = 1  #: stands for torchrun's own 30 s: shorter than the save
INTERVAL = 4  #: periodic saves, so a save cut short loses at most this many steps
OVERRIDES = ["training.measure_warmup_steps=1", f"training.checkpoint_interval={INTERVAL}",
             "training.keep_checkpoints=2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(out: Path) -> int:
    f = out / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def _term_during_run(out: Path, grace: int, log: Path) -> subprocess.Popen:
    """torchrun (one worker) trains tiny-cpu with slow saves; SIGTERM once a periodic save is done."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", ENV_SLOW_SAVE: str(SAVE_S)}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--max-restarts", "0",
           f"--shutdown-timeout={grace}", "--module", "muse_stack.cli", "run", "tiny-cpu", *OVERRIDES,
           "--steps", "400", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and _steps(out) <= INTERVAL + 1 and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and _steps(out) > INTERVAL + 1, log.read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)  # as srun passes the batch script's warning to each node's torchrun
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("torchrun did not stop: " + log.read_text()[-3000:])
    return proc


def _latest(out: Path) -> int:
    return json.loads((out / "checkpoints" / "latest").read_text())["step"]


def test_the_launchers_grace_lets_a_slow_save_finish(tmp_path):
    grace = signal_seconds(SAVE_S, None, floor=0)
    assert grace > SAVE_S > TORCHRUN_GRACE_S
    out = tmp_path / "run"
    _term_during_run(out, grace, tmp_path / "run.log")
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "interrupted", (tmp_path / "run.log").read_text()[-3000:]
    done = res["steps_completed"]
    assert done > INTERVAL + 1 and _latest(out) == done  # the save at the signal finished: nothing lost
    resumed = run(resume=out, stop_after=2, progress=False)
    assert resumed.results["resumed_at_step"] == done


def test_torchruns_own_grace_cuts_the_save_short_and_the_interval_bounds_the_loss(tmp_path):
    out = tmp_path / "run"
    _term_during_run(out, TORCHRUN_GRACE_S, tmp_path / "run.log")
    done = _steps(out)
    latest = _latest(out)
    assert latest < done, (tmp_path / "run.log").read_text()[-3000:]  # the signal's save was killed
    assert done - latest <= INTERVAL + 1  # the periodic save bounds the loss: the steps since it, and the one under way
    resumed = run(resume=out, stop_after=2, progress=False)
    assert resumed.results["resumed_at_step"] == latest
