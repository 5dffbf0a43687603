"""Reading run directories (metrics.jsonl, results.json, recipe.yaml) for comparison."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from muse_stack.util.errors import InputError

RUN_FIX = "pass a run directory written by `muse-stack run` (it holds metrics.jsonl, results.json, fingerprint.json)"


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    raw: dict[str, Any]


@dataclass
class Metrics:
    file: Path
    steps: list[StepRecord] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)


def require_run_dir(path: str | Path) -> Path:
    run = Path(path)
    if not run.exists():
        raise InputError(f"run directory {run} does not exist", field="run", value=str(run), fix=RUN_FIX)
    if not run.is_dir():
        raise InputError(f"{run} is not a directory", field="run", value=str(run), fix=RUN_FIX)
    return run


def _number(value: Any) -> float:
    """JSON numbers, and the NaN/Infinity spellings a metrics writer may emit; null is NaN."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        raise TypeError("boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value)  # "nan", "inf", "-inf", "1.5"
    raise TypeError(type(value).__name__)


def read_metrics(run: Path) -> Metrics:
    file = run / "metrics.jsonl"
    if not file.exists():
        raise InputError(f"{file} does not exist", field="metrics", value=str(file), fix=RUN_FIX)
    metrics = Metrics(file=file)
    seen: set[int] = set()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{file} is unreadable: {exc}", field="metrics", value=str(file), fix=RUN_FIX) from exc
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            step = obj["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise ValueError(f"step must be a positive integer, got {step!r}")
            loss = _number(obj.get("loss"))
            grad = _number(obj.get("grad_norm"))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise InputError(
                f"{file} line {lineno} is not a metrics record: {str(exc)[:200]}",
                field="metrics",
                value=line[:120],
                fix="each line must be a JSON object with an integer step, a loss and a grad_norm; "
                "the file is corrupt or was not written by `muse-stack run`",
            ) from exc
        if step in seen:
            metrics.duplicates.append(step)
            continue
        seen.add(step)
        metrics.steps.append(StepRecord(step, loss, grad, obj))
    metrics.steps.sort(key=lambda r: r.step)
    return metrics


def _json_file(file: Path, what: str) -> dict[str, Any] | None:
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InputError(f"{file} is not valid JSON: {str(exc)[:200]}", field=what, value=str(file),
                         fix="the file is corrupt or truncated; " + RUN_FIX) from exc
    if not isinstance(data, dict):
        raise InputError(f"{file} is not a JSON object", field=what, value=str(file), fix=RUN_FIX)
    return data


def read_results(run: Path) -> dict[str, Any] | None:
    """results.json, or None when the run wrote none (reported, not fatal)."""
    return _json_file(run / "results.json", "results")


def read_recipe(run: Path) -> dict[str, Any]:
    file = run / "recipe.yaml"
    if not file.exists():
        raise InputError(f"{file} does not exist", field="recipe", value=str(file),
                         fix=RUN_FIX + "; or pass --recipe NAME to audit against a catalogue recipe")
    from muse_stack.util.safeio import load_yaml, read_text

    data = load_yaml(read_text(file, field="recipe", what="recipe.yaml", fix=RUN_FIX), source=str(file),
                     field="recipe", error=InputError)
    if not isinstance(data, dict):
        raise InputError(f"{file} is not a YAML mapping", field="recipe", value=str(file), fix=RUN_FIX)
    from muse_stack.recipes.options import migrate

    # a run recorded before the engine options were one section compares as the same recipe in the new form
    return migrate(data, warn=False)
