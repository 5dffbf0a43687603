"""What ``muse-stack run --resume DIR`` may continue, and with which recipe.

A run continues from the checkpoint ``checkpoints/latest`` names (step 0 when it has none),
whatever ``results.json`` says or whether it exists: a killed process writes nothing
more. The recipe it continues with is the one that checkpoint was trained with; an edited
``recipe.yaml``, new overrides, ``--steps`` or ``--gpus`` are refused, each changed field named,
unless ``--allow-change`` is given, and then the change is recorded (see :class:`Change`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from muse_stack.util.errors import InputError
from muse_stack.recipes.catalogue import parse_recipe, recipe_sha256
from muse_stack.recipes.overrides import apply_overrides
from muse_stack.recipes.schema import Recipe
from muse_stack.util.safeio import load_yaml, read_yaml
from muse_stack.run import checkpoints, rundir


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict) and doc:
        out: dict[str, Any] = {}
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: doc}


def changed_fields(before: Recipe, after: Recipe) -> dict[str, list[Any]]:
    """Dotted field -> [before, after] for every field that differs."""
    a, b = flatten(before.model_dump(mode="json")), flatten(after.model_dump(mode="json"))
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


@dataclass
class ResumePlan:
    path: Path
    recipe: Recipe  #: what the run continues with
    checkpoint: checkpoints.Checkpoint | None
    change: dict[str, Any] | None  #: the recorded change, when --allow-change accepted one


#: what to do about a damaged recipe.yaml in a run directory
_DAMAGED = "the run directory's recipe.yaml is damaged: restore it (its checkpoint keeps a copy), or start a new run"


def plan_resume(path: Path, extra: list[str], allow_change: bool, wanted: Recipe | None = None) -> ResumePlan:
    """``wanted``: the recipe a ``--resume auto`` command resolved (its name, overrides and
    flags), compared with the checkpoint's as the run's own recipe.yaml plus ``extra`` is."""
    if not rundir.is_run_dir(path):
        raise rundir.not_a_run(path, "--resume")
    current = checkpoints.latest(path)
    on_disk = read_yaml(path / rundir.RECIPE, field="--resume", what="recipe", fix=_DAMAGED)
    if wanted is None:
        wanted = parse_recipe(apply_overrides(on_disk, extra) if extra else on_disk, str(path / rundir.RECIPE))
    # the recipe the saved state was trained with: the checkpoint's copy; before the first
    # checkpoint, recipe.yaml as the fingerprint's hash recorded it
    if current is not None and current.recipe_text() is not None:
        baseline = parse_recipe(load_yaml(current.recipe_text(), source=str(current.path / checkpoints.RECIPE),
                                          field="--resume", error=InputError),
                                str(current.path / checkpoints.RECIPE))
        before_sha = recipe_sha256(baseline)
        fields = changed_fields(baseline, wanted)
    else:
        baseline = parse_recipe(on_disk, str(path / rundir.RECIPE))
        fields = changed_fields(baseline, wanted)
        before_sha = _recorded_sha(path) or recipe_sha256(baseline)
        # edited since the run started (no copy names the fields); a recipe.yaml written in an older form of the
        # format (hashed as written) and read into the current one is not edited
        if before_sha not in (recipe_sha256(baseline), _file_sha(path / rundir.RECIPE)):
            fields = {"recipe.yaml": [f"sha256 {before_sha[:12]}", f"sha256 {recipe_sha256(baseline)[:12]}"],
                      **fields}
    results = _results(path)
    done = current.step if current is not None else 0
    if results.get("status") == "completed" and not fields:
        raise InputError("the run completed; there is nothing to continue", field="--resume", value=str(path),
                         fix="start a new run, or continue it for more steps with --steps N --allow-change")
    if fields and not allow_change:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in fields.items()))
        raise InputError(f"resuming would change what the run trains: {listed}", field="--resume",
                         value=str(path), rule="a resumed run continues with the recipe its checkpoint was "
                                               "trained with",
                         fix="restore recipe.yaml and drop the new overrides / --steps / --gpus (with --resume "
                             "auto, or a RECIPE with --resume DIR: give the command the run was started with, or "
                             "leave RECIPE out: --resume DIR continues with the run's own recipe), or continue it "
                             "with `--resume DIR --allow-change` to record the change in the run")
    change = None
    if fields:
        change = {"at_step": done, "fields": fields,
                  "recipe_sha256_before": before_sha,
                  "recipe_sha256_after": recipe_sha256(wanted), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return ResumePlan(path=path, recipe=wanted, checkpoint=current, change=change)


def _results(path: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads((path / rundir.RESULTS).read_text())
    except (OSError, ValueError):
        return {}  # missing, or stale from a process that died


def _file_sha(file: Path) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError:
        return None


def _recorded_sha(path: Path) -> str | None:
    import json

    try:
        return json.loads((path / rundir.FINGERPRINT).read_text())["run_inputs"]["recipe_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


#: ``--resume auto``: what the run directory holds decides (see :func:`inspect_out`)
AUTO = "auto"

#: what a run writes in its directory; a clean restart removes these (run.log keeps its lines and
#: .lock, held by the restarting process, stays)
OUTPUTS = (rundir.RECIPE, rundir.FINGERPRINT, "fingerprint.resumed.json", rundir.RANKS, rundir.METRICS,
           rundir.RESULTS, "loss.png", "throughput.png", "tensorboard", "wandb", checkpoints.ROOT)


@dataclass
class Found:
    """What an ``--out`` directory holds, and so what a run there does."""

    action: str  #: new | restart | resume | completed
    path: Path
    results: dict[str, Any]
    checkpoint: checkpoints.Checkpoint | None = None


def inspect_out(path: Path, wanted: Recipe, *, auto: bool) -> Found:
    """Decide what a run with ``--out PATH`` does (``auto``: ``--resume auto``), reading only.

    Missing or empty: a new run. A run directory with a complete checkpoint: resume (auto only),
    whatever results.json says. A completed run: nothing (auto only). A diverged run: refused.
    A run without a checkpoint: a clean restart (auto), or without auto only when its last
    attempt failed before it recorded a step. Anything else: refused, as an existing path."""
    if not path.exists():
        return Found("new", path, {})
    if not path.is_dir():
        raise InputError("the run directory path is a file", field="--out", value=str(path),
                         fix="choose a directory path")
    if not any(path.iterdir()):
        return Found("new", path, {})
    if not rundir.is_run_dir(path):  # a user's own files (a recipe.yaml among them): never written over
        if auto:
            raise rundir.not_a_run(path, "--out")
        raise InputError("the --out directory already exists and is not a run directory; a run never "
                         "writes into another folder's files", field="--out", value=str(path),
                         fix="choose a new --out path (or omit it for a fresh one), or an empty one")
    exists = InputError("the run directory already exists; a run never overwrites another", field="--out",
                        value=str(path), fix="choose a new --out path (or omit it for a fresh one); continue the "
                                             "run with `--resume auto` (a cluster job's command) or --resume DIR")
    results = _results(path)
    current = checkpoints.latest(path)
    status = results.get("status")
    done = results.get("steps_completed") if isinstance(results.get("steps_completed"), int) else 0
    if status == "completed" and (current is None or current.step <= done):
        if not auto:
            raise exists
        on_disk = parse_recipe(read_yaml(path / rundir.RECIPE, field="--out", what="recipe", fix=_DAMAGED),
                               str(path / rundir.RECIPE))
        fields = changed_fields(on_disk, wanted)
        if fields:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in fields.items()))
            raise InputError(f"the run completed with another recipe: {listed}", field="--out", value=str(path),
                             fix="give the command the run was started with, a new --out, or continue it with "
                                 "`--resume DIR --steps N --allow-change`")
        return Found("completed", path, results, current)
    diverged_at = results.get("diverged_at_step")
    if status == "diverged" and (current is None or not isinstance(diverged_at, int) or current.step < diverged_at):
        raise InputError(f"the run diverged at step {diverged_at}; resuming it as it is would diverge again",
                         field="--out", value=str(path),
                         fix="continue it with `--resume DIR --allow-change` and a changed recipe (e.g. a lower "
                             "optimizer.lr), or start a new run with a new --out")
    if current is not None:
        if not auto:
            raise exists
        return Found("resume", path, results, current)
    if auto or (status == "failed" and done == 0 and not rundir.read_metrics(path)):
        return Found("restart", path, results)
    raise exists


def clear_outputs(path: Path) -> None:
    """Remove what an earlier attempt without a checkpoint wrote (:data:`OUTPUTS`)."""
    import shutil

    for name in OUTPUTS:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()
