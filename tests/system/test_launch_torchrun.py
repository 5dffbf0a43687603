"""Two torchrun "nodes" on localhost (c10d rendezvous, one CPU process each, gloo) train tiny-cpu:
the same loss curve as one process with the same global batch, and SIGTERM from the scheduler
leaves an interrupted run that `muse-stack run --resume` continues on both nodes."""

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

from muse_stack.run.pipeline import run

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(args: list[str], logs: Path, rdzv_id: str) -> list[subprocess.Popen]:
    """Two launcher processes, as two nodes would start them."""
    port = _port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    procs = []
    for node in range(2):
        cmd = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--max-restarts", "0",
               "--module", "muse_stack.cli", "run", *args, "--no-progress"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(logs / f"node{node}.log", "w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _wait_all(procs: list[subprocess.Popen], logs: Path, timeout: float = 240) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError("torchrun did not finish: " + "".join(f.read_text()[-2000:] for f in logs.glob("*.log")))


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_match_one_process(tmp_path):
    common = ["tiny-cpu", "training.measure_warmup_steps=2", "--steps", "6"]
    procs = _nodes([*common, "--out", str(tmp_path / "two")], tmp_path, "match")
    one = run("tiny-cpu", overrides=["training.measure_warmup_steps=2"], steps=6, out=tmp_path / "one",
              progress=False)
    rcs = _wait_all(procs, tmp_path)
    assert rcs == [0, 0], "".join(f.read_text()[-2000:] for f in tmp_path.glob("*.log"))
    two = tmp_path / "two"
    a, b = metrics(one.path), metrics(two)
    assert [m["step"] for m in b] == list(range(1, 7))
    # the same global batch: 8 sequences per step, 8 micro-batches in one process, 4 per rank in two
    assert [m["tokens"] for m in b] == [m["tokens"] for m in a]
    assert [m["supervised_tokens"] for m in b] == [m["supervised_tokens"] for m in a]
    # Two processes sum the same float32 terms in another order (each rank's half, then an
    # all-reduce). Each step's loss and gradient are sums over the step's tokens (8 x 128 = 1,024):
    # relative difference <= n u = 1,024 x 2^-24 = 6.1e-5 per step (Higham's summation bound, any
    # order). Adam's updates are normalised, so a relative gradient difference moves the weights by
    # the same relative amount and no more; over 6 steps the differences add: 6 x 6.1e-5 = 3.7e-4.
    # Seen: 4.6e-6 here, 1.66e-5 on another machine.
    steps, tokens = 6, 8 * 128
    rel = steps * tokens * 2.0**-24
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=rel)
    # the first step starts from the same weights: one step's bound for the gradient's norm
    assert b[0]["grad_norm"] == pytest.approx(a[0]["grad_norm"], rel=tokens * 2.0**-24)
    results = json.loads((two / "results.json").read_text())
    assert results["status"] == "completed" and results["world_size"] == 2
    assert len(results["peak_memory_gib_by_rank"]) == 2 and all(p > 0 for p in results["peak_memory_gib_by_rank"])
    assert sorted(p.name for p in (two / "fingerprints").iterdir()) == ["rank-0.json", "rank-1.json"]
    fp = json.loads((two / "fingerprint.json").read_text())
    assert fp["ranks"]["count"] == 2 and fp["ranks"]["agree"] is True


def test_sigterm_on_one_node_interrupts_both_then_resume(tmp_path):
    out = tmp_path / "run"
    procs = _nodes(["tiny-cpu", "training.measure_warmup_steps=2", "--steps", "40", "--out", str(out)], tmp_path,
                   "term")
    deadline = time.time() + 60
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    # the scheduler signals the launchers (srun passes the batch script's TERM to every node's task);
    # torchrun passes it to its worker, and the stop flag, all-reduced after every step, stops all
    # ranks after the same step whichever of them saw the signal first
    for p in procs:
        p.send_signal(signal.SIGTERM)
    _wait_all(procs, tmp_path)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "interrupted", "".join(f.read_text()[-2000:] for f in tmp_path.glob("*.log"))
    done_steps = res["steps_completed"]
    assert 3 <= done_steps < 40 and len(metrics(out)) == done_steps
    latest = json.loads((out / "checkpoints" / "latest").read_text())
    assert latest["step"] == done_steps
    assert json.loads((out / "checkpoints" / latest["folder"] / "trainer_state.json").read_text())["step"] == done_steps

    before = metrics(out)
    procs = _nodes(["--resume", str(out)], tmp_path, "resume")
    rcs = _wait_all(procs, tmp_path)
    assert rcs == [0, 0], "".join(f.read_text()[-2000:] for f in tmp_path.glob("*.log"))
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and res["resumed_at_step"] == done_steps and res["world_size"] == 2
    after = metrics(out)
    assert [m["step"] for m in after] == list(range(1, 41))
    assert after[:done_steps] == before
    assert after[-1]["loss"] < after[0]["loss"]
