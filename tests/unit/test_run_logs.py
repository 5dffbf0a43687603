"""Logs as cluster users read them: without a progress bar, a step line on stdout every
``training.log_interval`` steps; the interval also paces TensorBoard and W&B, while
metrics.jsonl keeps every step."""

from __future__ import annotations

import io
import json
import re

import pytest

from muse_stack.run.pipeline import run
from muse_stack.run.sinks import RunStart, StdoutSink

LINE = re.compile(r"^step (\d+)/(\d+) \| loss (\S+) \| grad_norm (\S+) \| lr (\S+) \| ([\d,]+) tokens/s \| "
                  r"ETA (\d+):(\d\d):(\d\d)$")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, one_thread):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_no_progress_prints_a_step_line_every_log_interval(tmp_path, cli, monkeypatch):
    seen: list[int] = []

    class Recorder:  # stands for any experiment logger (TensorBoard, W&B): what the trainer hands it
        def on_start(self, *a):
            pass

        def on_step(self, step, metrics):
            seen.append(step)

        def on_end(self, results):
            pass

        def close(self):
            pass

    from muse_stack.run import tensorboard

    real = tensorboard.sinks_for
    monkeypatch.setattr(tensorboard, "sinks_for", lambda *a, **k: [*real(*a, **k), Recorder()])
    out = tmp_path / "logs"
    rc, text, err = cli("run", "tiny-cpu", "--out", out, "--no-progress", "--steps", "7", "batch.gbs=2",
                        "training.log_interval=3", "training.measure_warmup_steps=1")
    assert rc == 0, err
    lines = [m for m in map(LINE.match, text.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [3, 6, 7]  # every 3rd step and the last
    assert all(int(m.group(2)) == 7 for m in lines)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))  # the file keeps every step
    for m in lines:
        row = rows[int(m.group(1)) - 1]
        assert m.group(3) == f"{row['loss']:.4f}" and m.group(4) == f"{row['grad_norm']:.3f}"
        assert m.group(5) == f"{row['lr']:.3g}"
    last = int(lines[-1].group(7)) * 3600 + int(lines[-1].group(8)) * 60 + int(lines[-1].group(9))
    assert last == 0  # nothing left after the last step
    assert seen == [3, 6, 7]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [3, 6, 7]


def test_the_step_line_rate_and_eta_come_from_the_steps_since_the_last_line():
    stream = io.StringIO()
    sink = StdoutSink(2, stream)
    sink.open(RunStart([], 6))
    for step, (tokens, seconds) in enumerate([(100, 1.0), (300, 1.0), (50, 0.5), (150, 0.5)], start=1):
        sink.log({"step": step, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "tokens": tokens, "step_time_s": seconds})
    first, second = stream.getvalue().splitlines()
    # steps 1-2: 400 tokens in 2 s = 200 tokens/s, 4 steps left at 1 s each
    assert first == "step 2/6 | loss 1.0000 | grad_norm 0.500 | lr 0.001 | 200 tokens/s | ETA 0:00:04"
    # steps 3-4: 200 tokens in 1 s, 2 steps left at 0.5 s each
    assert second.endswith("| 200 tokens/s | ETA 0:00:01")


def test_a_resumed_run_says_where_it_went_on_on_stdout_and_on_the_progress_console():
    from rich.console import Console

    from muse_stack.run.sinks import ProgressSink

    stream = io.StringIO()
    StdoutSink(2, stream).open(RunStart([{"step": 1}] * 3, 6, resumed_step=3))
    assert stream.getvalue() == "resumed at step 3\n"
    fresh = io.StringIO()
    StdoutSink(2, fresh).open(RunStart([], 6))
    assert fresh.getvalue() == ""
    shown = io.StringIO()
    bar = ProgressSink("tiny-cpu", Console(file=shown, force_terminal=False, width=100))
    bar.open(RunStart([{"step": 1}] * 3, 6, resumed_step=3))
    bar.close()
    assert shown.getvalue().splitlines()[0] == "resumed at step 3"
