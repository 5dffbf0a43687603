"""Where each step's metrics row goes: one logger protocol, one container the trainer fans out to.

A :class:`MetricLogger` is opened with the run's start (the rows already recorded: a resumed
run's history, cut back to its checkpoint; the step count; the resolved recipe and the stack),
receives every new step row, is given the run's results at the end, and is closed once (closing
twice is safe). ``metrics.jsonl``, the ``run.log`` line, and the progress bar or the stdout
line are loggers here; TensorBoard and W&B (:mod:`muse_stack.run.tensorboard`) become loggers
through :class:`Paced`, which hands them every ``log_interval``-th step's training values and
every validation loss. :func:`loggers_for` builds them all, on rank 0 only, into one
:class:`MetricLoggers`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from muse_stack.util import atomic

log = logging.getLogger("muse_stack.run")
Row = dict[str, Any]


#: the keys a step row carries for its validation loss (recipe ``validation``)
VALIDATION_KEYS = ("val_loss", "val_supervised_tokens", "val_s")


@dataclass
class RunStart:
    """What every logger is opened with."""

    history: list[Row]
    total_steps: int
    recipe_text: str = ""
    stack: Mapping[str, Any] = field(default_factory=dict)
    #: the step a resumed run continues after (None: a run from its start)
    resumed_step: int | None = None


class MetricLogger(Protocol):
    def open(self, start: RunStart) -> None: ...

    def log(self, row: Row) -> None: ...

    def end(self, results: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class _Quiet:
    """What a logger without a start text or results does with them: nothing."""

    def end(self, results: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(_Quiet):
    """``metrics.jsonl``: one fsynced line per step. Opening rewrites the file with exactly the
    history (what a resume keeps), which also drops a line torn by a crash or a full disk."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, start: RunStart) -> None:
        atomic.write_text(self.path, "".join(json.dumps(r) + "\n" for r in start.history))

    def log(self, row: Row) -> None:
        atomic.append_line(self.path, json.dumps(row))


class LogSink(_Quiet):
    """One line per step in run.log."""

    def open(self, start: RunStart) -> None:
        pass

    def log(self, row: Row) -> None:
        log.info("step %d loss %.4f grad_norm %.3f lr %.3g %.3fs", row["step"], row["loss"], row["grad_norm"],
                 row["lr"], row["step_time_s"])
        if row.get("val_loss") is not None:
            log.info("step %d val_loss %.4f", row["step"], row["val_loss"])


class StdoutSink(_Quiet):
    """Without a progress bar (cluster jobs, ``--no-progress``): one line on stdout every
    ``log_interval`` steps and at the last step, with the step's loss, gradient norm and learning
    rate, the tokens/s of the steps since the previous line and the time left at that pace::

        step 40/100 | loss 2.3512 | grad_norm 0.812 | lr 0.000287 | 12,345 tokens/s | ETA 0:01:12

    a first line ``resumed at step N`` when the run continues from a checkpoint (a requeued job's log),

    and a line for each validation loss (recipe ``validation``), at its step whatever the interval::

        step 40/100 | val_loss 2.4107 | val_ppl 11.14 | 8,192 supervised tokens | 1.3s
    """

    def __init__(self, interval: int, stream: Any = None) -> None:
        self.interval = max(1, int(interval))
        self.stream = stream
        self.total = 0
        self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def open(self, start: RunStart) -> None:
        self.total = start.total_steps
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        if start.resumed_step is not None:  # a requeued job's log says where it went on
            print(f"resumed at step {start.resumed_step}", file=self.stream or sys.stdout, flush=True)

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


class ProgressSink(_Quiet):
    """The rich progress bar on stderr."""

    def __init__(self, title: str, console: Console) -> None:
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=console, transient=False)
        self.title = title
        self.task = None

    def open(self, start: RunStart) -> None:
        if start.resumed_step is not None:
            self.bar.console.print(f"resumed at step {start.resumed_step}", markup=False, highlight=False)
        self.bar.start()
        self.task = self.bar.add_task(self.title, total=start.total_steps, completed=len(start.history), loss="-")

    def log(self, row: Row) -> None:
        self.bar.update(self.task, advance=1, loss=f"{row['loss']:.4f}")
        if row.get("val_loss") is not None:
            self.bar.console.print(validation_line(row, int(self.bar.tasks[0].total or 0)), highlight=False)

    def close(self) -> None:
        self.bar.stop()


class Paced(_Quiet):
    """An experiment logger with callbacks (``on_start``, ``on_step``, ``on_validation``,
    ``on_end``, ``close``: TensorBoard, W&B) as a :class:`MetricLogger`: its training values every
    ``interval`` steps and at the last step (``training.log_interval``), every validation loss."""

    def __init__(self, logger: Any, interval: int) -> None:
        self.logger, self.interval, self.total = logger, max(1, int(interval)), 0

    def open(self, start: RunStart) -> None:
        self.total = start.total_steps
        self.logger.on_start(start.recipe_text, start.stack)

    def log(self, row: Row) -> None:
        step = row["step"]
        if not step % self.interval or step == self.total:
            self.logger.on_step(step, {k: v for k, v in row.items() if k not in VALIDATION_KEYS})
        if row.get("val_loss") is not None and hasattr(self.logger, "on_validation"):
            self.logger.on_validation(step, {"loss": row["val_loss"]})

    def end(self, results: Mapping[str, Any]) -> None:
        self.logger.on_end(results)

    def close(self) -> None:
        self.logger.close()


class MetricLoggers:
    """The one list the trainer fans out to; ``close`` closes each once."""

    def __init__(self, loggers: list[MetricLogger]) -> None:
        self.loggers = list(loggers)

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def open(self, start: RunStart) -> None:
        for logger in self.loggers:
            logger.open(start)

    def log(self, row: Row) -> None:
        for logger in self.loggers:
            logger.log(row)

    def end(self, results: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.end(results)

    def close(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()


def loggers_for(recipe: Any, run_dir: Path, *, rank: int, progress: bool, console: Console, stream: Any = None,
                resumed_step: int | None = None) -> MetricLoggers:
    """metrics.jsonl and run.log get every step; the progress bar, or without it one stdout line
    every ``training.log_interval`` steps; then the experiment loggers the recipe's ``logging``
    section asks for (:func:`muse_stack.run.tensorboard.sinks_for`), paced the same way. Rank 0
    only (an empty container elsewhere)."""
    from muse_stack.run import tensorboard

    if rank != 0:
        return MetricLoggers([])
    interval = recipe.training.log_interval
    loggers: list[MetricLogger] = [JsonlSink(run_dir / "metrics.jsonl"), LogSink()]
    loggers.append(ProgressSink(recipe.name, console) if progress else StdoutSink(interval, stream))
    loggers += [Paced(x, interval) for x in tensorboard.sinks_for(recipe, run_dir, rank, resumed_step=resumed_step)]
    return MetricLoggers(loggers)
