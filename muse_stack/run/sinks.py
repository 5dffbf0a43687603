"""Where each step's metrics row goes: a list of sinks the training loop fans out to.

A sink is opened with the rows already recorded (a resumed run's history, cut back to its
checkpoint), receives every new row, and is closed once. ``metrics.jsonl`` is the first;
the log line and the progress bar are two more; a TensorBoard or W&B writer is one more
class with these three methods, added in :func:`sinks_for`. Only rank 0 has sinks.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from muse_stack import atomic

log = logging.getLogger("muse_stack.run")
Row = dict[str, Any]


class MetricSink(Protocol):
    def open(self, history: list[Row], total_steps: int) -> None: ...

    def log(self, row: Row) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``metrics.jsonl``: one fsynced line per step. Opening rewrites the file with exactly the
    history (what a resume keeps), which also drops a line torn by a crash or a full disk."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, history: list[Row], total_steps: int) -> None:
        atomic.write_text(self.path, "".join(json.dumps(r) + "\n" for r in history))

    def log(self, row: Row) -> None:
        atomic.append_line(self.path, json.dumps(row))

    def close(self) -> None:
        pass


class LogSink:
    """One line per step in run.log."""

    def open(self, history: list[Row], total_steps: int) -> None:
        pass

    def log(self, row: Row) -> None:
        log.info("step %d loss %.4f grad_norm %.3f lr %.3g %.3fs", row["step"], row["loss"], row["grad_norm"],
                 row["lr"], row["step_time_s"])
        if row.get("val_loss") is not None:
            log.info("step %d val_loss %.4f", row["step"], row["val_loss"])

    def close(self) -> None:
        pass


class StdoutSink:
    """Without a progress bar (cluster jobs, ``--no-progress``): one line on stdout every
    ``log_interval`` steps and at the last step, with the step's loss, gradient norm and learning
    rate, the tokens/s of the steps since the previous line and the time left at that pace::

        step 40/100 | loss 2.3512 | grad_norm 0.812 | lr 0.000287 | 12,345 tokens/s | ETA 0:01:12

    and a line for each validation loss (recipe ``validation``), at its step whatever the interval::

        step 40/100 | val_loss 2.4107 | val_ppl 11.14 | 8,192 supervised tokens | 1.3s
    """

    def __init__(self, interval: int, stream: Any = None) -> None:
        self.interval = max(1, int(interval))
        self.stream = stream
        self.total = 0
        self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def open(self, history: list[Row], total_steps: int) -> None:
        self.total = total_steps
        self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def log(self, row: Row) -> None:
        self._steps += 1
        self._tokens += row["tokens"]
        self._seconds += row["step_time_s"]
        step = row["step"]
        out = self.stream or sys.stdout
        if not step % self.interval or step == self.total:
            rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
            left = max(0, self.total - step) * self._seconds / self._steps
            print(f"step {step}/{self.total} | loss {row['loss']:.4f} | grad_norm {row['grad_norm']:.3f} | "
                  f"lr {row['lr']:.3g} | {rate:,.0f} tokens/s | ETA {_clock(left)}", file=out, flush=True)
            self._steps, self._tokens, self._seconds = 0, 0, 0.0
        if row.get("val_loss") is not None:
            print(validation_line(row, self.total), file=out, flush=True)

    def close(self) -> None:
        pass


def validation_line(row: Row, total: int) -> str:
    """The line a validation loss gets (perplexity as Megatron-Bridge prints it: exp of the loss, capped at 20)."""
    import math

    loss = row["val_loss"]
    ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else math.nan
    return (f"step {row['step']}/{total} | val_loss {loss:.4f} | val_ppl {ppl:.4g} | "
            f"{row.get('val_supervised_tokens', 0):,} supervised tokens | {row.get('val_s', 0.0):.1f}s")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressSink:
    """The rich progress bar on stderr."""

    def __init__(self, title: str, console: Console) -> None:
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=console, transient=False)
        self.title = title
        self.task = None

    def open(self, history: list[Row], total_steps: int) -> None:
        self.bar.start()
        self.task = self.bar.add_task(self.title, total=total_steps, completed=len(history), loss="-")

    def log(self, row: Row) -> None:
        self.bar.update(self.task, advance=1, loss=f"{row['loss']:.4f}")
        if row.get("val_loss") is not None:
            self.bar.console.print(validation_line(row, int(self.bar.tasks[0].total or 0)), highlight=False)

    def close(self) -> None:
        self.bar.stop()


def sinks_for(run_dir: Path, title: str, *, rank: int, progress: bool, console: Console,
              log_interval: int = 1, stream: Any = None) -> list[MetricSink]:
    """metrics.jsonl and run.log get every step; the progress bar, or without it one stdout line
    every ``log_interval`` steps (``training.log_interval``)."""
    if rank != 0:
        return []
    sinks: list[MetricSink] = [JsonlSink(run_dir / "metrics.jsonl"), LogSink()]
    sinks.append(ProgressSink(title, console) if progress else StdoutSink(log_interval, stream))
    return sinks
