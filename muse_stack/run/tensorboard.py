"""Metric sinks beside ``metrics.jsonl``: TensorBoard event files and, optionally, Weights & Biases.

Each sink is a component with the same five calls, made on one rank (rank 0):

- ``on_start(recipe_text, fingerprint_summary)``: the resolved recipe and the stack fingerprint's
  summary, as text;
- ``on_step(step, metrics)``: every numeric value of a step's metrics record, as a scalar at that step;
- ``on_validation(step, values)``: a validation loss (recipe ``validation``) as ``val/loss`` at its step;
- ``on_end(results)``: the run's results (``results.json``), numeric ones as scalars at the last step
  and all of them as a text table;
- ``close()``: flush and close (safe to call twice).

:func:`sinks_for` builds the ones a recipe's ``logging`` section asks for. TensorBoard writes under
``RUN_DIR/tensorboard`` (``tensorboard --logdir runs/`` shows every run); W&B logs offline under
``RUN_DIR/wandb`` when no API key is present, and its key is read from the environment by wandb
itself, never written by muse-stack.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the folder under a run directory that holds the TensorBoard event files
TENSORBOARD_DIR = "tensorboard"
#: the folder under a run directory that holds W&B's offline run
WANDB_DIR = "wandb"


def _scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a (nested) mapping, keyed by their '/'-joined path; bools, strings and
    None are left out (NaN and Inf are kept: a diverging loss must show)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _markdown_table(values: Mapping[str, Any]) -> str:
    rows = ["| field | value |", "| --- | --- |"]
    for key, value in values.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        rows.append(f"| {key} | {str(text).replace('|', '&#124;')} |")
    return "\n".join(rows)


def _summary_text(summary: str | Mapping[str, Any]) -> str:
    return summary if isinstance(summary, str) else _markdown_table(summary)


def _fenced(text: str, lang: str = "") -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}{lang}\n{text}\n{fence}"


class TensorBoardLogger:
    """TensorBoard event files under ``RUN_DIR/tensorboard``, written with torch's SummaryWriter."""

    def __init__(self, run_dir: str | Path, *, flush_secs: int = 30, resumed_step: int | None = None) -> None:
        """``resumed_step``: a run continued from its checkpoint at that step. The writer then
        purges (TensorBoard's ``purge_step``) every event a killed attempt logged after it, so a
        step the resumed run logs again shows once, and the recipe and fingerprint of this
        attempt are logged at the first step after it."""
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._start = 0 if resumed_step is None else int(resumed_step) + 1
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs,
                                          purge_step=self._start if resumed_step is not None else None)
        self._last_step = 0

    def on_start(self, recipe_text: str, fingerprint_summary: str | Mapping[str, Any]) -> None:
        self._writer.add_text("recipe", _fenced(recipe_text, "yaml"), global_step=self._start)
        self._writer.add_text("fingerprint", _summary_text(fingerprint_summary), global_step=self._start)
        self._writer.flush()

    def on_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._last_step = max(self._last_step, int(step))
        for name, value in _scalars({k: v for k, v in metrics.items() if k != "step"}).items():
            self._writer.add_scalar(f"train/{name}", value, global_step=int(step))

    def on_validation(self, step: int, values: Mapping[str, Any]) -> None:
        self._last_step = max(self._last_step, int(step))
        for name, value in _scalars(values).items():
            self._writer.add_scalar(f"val/{name}", value, global_step=int(step))

    def on_end(self, results: Mapping[str, Any]) -> None:
        step = results.get("steps_completed")
        step = int(step) if isinstance(step, int) and not isinstance(step, bool) else self._last_step
        for name, value in _scalars(results).items():
            self._writer.add_scalar(f"results/{name}", value, global_step=step)
        self._writer.add_text("results", _markdown_table(results), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def wandb_mode(configured: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The W&B mode: as configured, else online when an API key is in the environment, else offline."""
    if configured is not None:
        return configured
    env = os.environ if environ is None else environ
    return "online" if env.get("WANDB_API_KEY") else "offline"


class WandbLogger:
    """Weights & Biases (the ``wandb`` extra). The config sent is the resolved recipe, which the
    schema keeps free of secrets; the API key stays in wandb's own environment handling."""

    def __init__(self, run_dir: str | Path, config: Any, *, run_name: str | None = None) -> None:
        try:
            import wandb
        except ImportError:
            from muse_stack.util.errors import RecipeError

            raise RecipeError("logging.wandb is set but wandb is not installed", field="logging.wandb",
                              value=config.project, fix="pip install 'muse-stack[wandb]', or remove logging.wandb") from None
        self.mode = wandb_mode(config.mode)
        self.dir = Path(run_dir) / WANDB_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(project=config.project, entity=config.entity, group=config.group,
                                    tags=list(config.tags) or None, name=config.name or run_name or Path(run_dir).name,
                                    dir=str(self.dir), mode=self.mode)
        self._wandb = wandb
        self._last_step = 0

    def on_start(self, recipe_text: str, fingerprint_summary: str | Mapping[str, Any]) -> None:
        import yaml

        self._run.config.update(yaml.safe_load(recipe_text) or {}, allow_val_change=True)
        self._run.summary["fingerprint"] = _summary_text(fingerprint_summary)

    def on_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._last_step = max(self._last_step, int(step))
        values = {f"train/{k}": v for k, v in _scalars({k: v for k, v in metrics.items() if k != "step"}).items()}
        self._run.log(values, step=int(step))

    def on_validation(self, step: int, values: Mapping[str, Any]) -> None:
        self._last_step = max(self._last_step, int(step))
        self._run.log({f"val/{k}": v for k, v in _scalars(values).items()}, step=int(step))

    def on_end(self, results: Mapping[str, Any]) -> None:
        for name, value in _scalars(results).items():
            self._run.summary[f"results/{name}"] = value if math.isfinite(value) else str(value)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def check_available(recipe: Any) -> None:
    """The loggers the recipe asks for can start here: refused before the run directory exists."""
    if recipe.logging.wandb is not None and recipe.logging.wandb.mode != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            from muse_stack.util.errors import RecipeError

            raise RecipeError("logging.wandb is set but wandb is not installed", field="logging.wandb",
                              value=recipe.logging.wandb.project,
                              fix="pip install 'muse-stack[wandb]' (or use an image that has it), or remove "
                                  "logging.wandb (logging.wandb.mode=disabled)")


def sinks_for(recipe: Any, run_dir: str | Path, rank: int = 0,
              resumed_step: int | None = None) -> list[TensorBoardLogger | WandbLogger]:
    """The metric sinks the recipe's ``logging`` section asks for, on rank 0 only (none elsewhere).
    ``resumed_step``: the checkpoint step a resumed run continues from."""
    if rank != 0:
        return []
    sinks: list[TensorBoardLogger | WandbLogger] = []
    if recipe.logging.tensorboard:
        sinks.append(TensorBoardLogger(run_dir, resumed_step=resumed_step))
    if recipe.logging.wandb is not None and recipe.logging.wandb.mode != "disabled":
        sinks.append(WandbLogger(run_dir, recipe.logging.wandb))
    return sinks
