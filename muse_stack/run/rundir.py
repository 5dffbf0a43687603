"""The run directory: a new folder per run, never overwritten, read back by compare and export."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse_stack.util import atomic
from muse_stack.util.errors import InputError
from muse_stack.recipes.catalogue import parse_recipe, recipe_yaml
from muse_stack.recipes.schema import Recipe

RECIPE = "recipe.yaml"
FINGERPRINT = "fingerprint.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
LOG = "run.log"
RANKS = "fingerprints"


#: what a run writes beside recipe.yaml (the lock first, before recipe.yaml: :func:`create`); a folder holding
#: a recipe.yaml and none of these is not a run (a user's own recipe file, say) and is never written over
MARKS = (".lock", FINGERPRINT, METRICS, RESULTS, LOG, "checkpoints")


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run directory: its recipe.yaml and at least one of :data:`MARKS`."""
    path = Path(path)
    return (path / RECIPE).is_file() and any((path / mark).exists() or (path / mark).is_symlink() for mark in MARKS)


def not_a_run(path: Path, field: str) -> InputError:
    """The refusal of a folder that is not a run directory, as ``field`` names it; nothing in it is touched."""
    why = ("its recipe.yaml is no run's: a run directory also holds what the run wrote (.lock, fingerprint.json, "
           "metrics.jsonl, results.json, run.log or checkpoints/)" if (Path(path) / RECIPE).is_file()
           else "no recipe.yaml")
    return InputError(f"not a run directory ({why}); nothing there is changed", field=field, value=str(path),
                      fix="give a directory written by `muse-stack run`" if field == "--resume" else
                      "choose a new --out path, or an empty or missing one (a recipe file is given as RECIPE, "
                      "e.g. `muse-stack run exp/recipe.yaml --out exp/run-1`)")


def default_run_dir(recipe_name: str, base: str | os.PathLike[str] = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(base) / f"{recipe_name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(base) / f"{recipe_name}-{stamp}-{n}"
    return path


def create(path: Path, recipe: Recipe) -> Path:
    """Make a new run directory and write the resolved recipe; refuse an existing path (an empty
    directory aside: a job's mounted or pre-made output folder)."""
    if path.is_dir() and not any(path.iterdir()):
        _mark(path)
        atomic.write_text(path / RECIPE, recipe_yaml(recipe))
        return path
    if path.exists():
        raise InputError("the run directory already exists; a run never overwrites another",
                         field="--out", value=str(path),
                         fix="choose a new --out path (or omit it for a fresh one), or continue it with --resume"
                         if is_run_dir(path) else "choose a new --out path (or omit it for a fresh one)")
    make_dir(path, "--out")
    _mark(path)
    atomic.write_text(path / RECIPE, recipe_yaml(recipe))
    return path


def _mark(path: Path) -> None:
    """The lock file made before recipe.yaml, so a run killed at once is still a run (:func:`is_run_dir`)."""
    from muse_stack.run.dirlock import LOCK

    try:
        (path / LOCK).touch()
    except OSError as exc:
        raise InputError(f"cannot write in the run directory: {exc.strerror or exc}", field="--out",
                         value=str(path), fix="choose a path under a directory you can write to") from exc


def make_dir(path: Path, field: str) -> None:
    """Create a new directory (and its parents); a parent that is a file, read-only or otherwise
    unusable is an InputError naming ``field``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
    except FileExistsError as exc:
        raise InputError("the path already exists", field=field, value=str(path), fix="choose a new path") from exc
    except NotADirectoryError as exc:
        raise InputError("a parent of the path is a file, not a directory", field=field, value=str(path),
                         fix="choose a path under a directory") from exc
    except OSError as exc:
        raise InputError(f"cannot create the directory: {exc.strerror or exc}", field=field, value=str(path),
                         fix="choose a path under a directory you can write to") from exc


@dataclass
class RunRecord:
    path: Path
    recipe: Recipe
    results: dict[str, Any] | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: dict[str, Any] | None = None

    def stack_summary(self) -> dict[str, Any] | None:
        """The recorded-stack view of this run's fingerprint, for an OpenRecipes record."""
        fp = self.fingerprint
        if not fp:
            return None
        from muse_stack.results.stack import summarise

        return summarise(fp)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every row of metrics.jsonl. A last line cut short (a process killed, or a full disk,
    mid-write) is left out with a warning; a broken line before it is an error."""
    rows = []
    file = path / METRICS
    if not file.exists():
        return rows
    from muse_stack.util.safeio import load_json, read_text

    fix = "the file is corrupt; re-run or remove the broken line"
    lines = read_text(file, field=METRICS, what="metrics file", fix=fix, limit=None).splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # a write cut short (SIGKILL, full disk): the last row is dropped
                logging.getLogger("muse_stack.run").warning("%s:%d: torn last line left out (%s)", file, n, exc)
                break
        rows.append(load_json(line, source=f"{file}:{n}", field=METRICS, fix=fix))
    return rows


def read_run(path: str | os.PathLike[str]) -> RunRecord:
    path = Path(path)
    if not (path / RECIPE).is_file():
        raise InputError("not a run directory (no recipe.yaml)", field="run", value=str(path),
                         fix="give a directory written by `muse-stack run`")
    from muse_stack.util.safeio import load_yaml, read_text

    fix = "give a directory written by `muse-stack run` (its recipe.yaml is corrupt)"
    text = read_text(path / RECIPE, field="run", what="recipe.yaml", fix=fix)
    recipe = parse_recipe(load_yaml(text, source=str(path / RECIPE), field="run", error=InputError), str(path / RECIPE))
    from muse_stack.compare.runs import read_results
    from muse_stack.fingerprint.document import load_fingerprint

    results = read_results(path)
    fingerprint = load_fingerprint(path) if (path / FINGERPRINT).is_file() else None
    return RunRecord(path=path, recipe=recipe, results=results, metrics=read_metrics(path), fingerprint=fingerprint)
