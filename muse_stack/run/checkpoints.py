"""The run's checkpoints: step-named folders, a ``latest`` pointer, an interval and keep-last-N.

Layout under the run directory::

    checkpoints/
      step-00000020/        one complete checkpoint: the engine's files, trainer_state.json,
                            the recipe it was trained with, the metrics rows up to its step
        rng/rank-00000.pt   and each rank's share of the run's state (see below)
      step-00000040/
      latest                {"step": 40, "folder": "step-00000040"}, replaced atomically

A save writes ``step-N.partial/`` (the engine writes its state there: an HF-style
checkpoint on the reference engine, a dist-checkpoint on the megatron engine), adds each rank's
share of the run's state (``rng/rank-NNNNN.pt``: the ``state_dict`` of each of the run's
components by name, taken when the save began: the random generators and the data position,
:meth:`muse_stack.run.steps.TrainSteps.states`) and the trainer's files, renames the folder to
``step-N`` and only then replaces ``latest``; old folders are pruned after that. A process
killed at any moment therefore leaves ``latest`` naming a complete folder (or no ``latest`` at
all), and resume trusts only what it names: ``*.partial`` folders and folders newer than
``latest`` are discarded, and so are the hidden staging entries a killed writer leaves beside
them (``.step-N.partial.*``: a staged copy of the weights; ``.latest.*``: a staged pointer), at
resume and before each save. No reader takes a hidden entry for a checkpoint: only ``step-N``
folders are step folders.

An engine whose ``save`` only starts writing (megatron-core's asynchronous dist-checkpoint
save) exposes ``finalize_save(blocking) -> bool``; the folder is completed and ``latest``
moved when that reports the write done, at a step boundary or before the next save or exit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse_stack.util import atomic
from muse_stack.util.errors import InputError, MuseStackError
from muse_stack.run import dist
from muse_stack.run import faults

log = logging.getLogger("muse_stack.run")

ROOT = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
_STEP = re.compile(r"^step-(\d+)$")
#: what a writer killed mid-save leaves in checkpoints/: the staging folder (and the folder it
#: replaces) of an atomic checkpoint write into step-N.partial, and a staged file of ``latest``
_STAGING = re.compile(r"^\.(step-\d+(\.partial)?\.|latest\.)")


#: free space asked beyond the engine's estimate: the dist-checkpoint's metadata and the
#: trainer's files (recipe, metrics) add well under 2% on the runs in benchmarks/results/ckpt-save
SPACE_MARGIN = 1.02


class CheckpointError(MuseStackError):
    """A checkpoint could not be written (the previous one is intact)."""

    exit_code = 4


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


#: what to do about a damaged file in a checkpoint folder
DAMAGED = "the checkpoint is damaged: restore it from a copy, or point checkpoints/latest at an earlier step folder"


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    #: False when ``checkpoints/latest`` is missing and this is the newest complete step folder found
    #: by scanning (:func:`latest`)
    named: bool = field(default=True, compare=False)

    def recipe_text(self) -> str | None:
        from muse_stack.util.safeio import read_text

        file = self.path / RECIPE
        return read_text(file, field="--resume", what="checkpoint recipe", fix=DAMAGED) if file.is_file() else None

    def metrics_rows(self) -> list[dict[str, Any]] | None:
        from muse_stack.util.safeio import load_json, read_text

        file = self.path / METRICS
        if not file.is_file():
            return None
        text = read_text(file, field="--resume", what="metrics log", fix=DAMAGED, limit=None)
        return [load_json(line, source=f"{file} line {i}", field="--resume", fix=DAMAGED)
                for i, line in enumerate(text.splitlines(), start=1) if line.strip()]


def latest(run_dir: Path) -> Checkpoint | None:
    """The checkpoint ``latest`` names, checked whole; None when the run has none yet. Without
    ``latest`` (a save killed between its folder's rename and the pointer's first write, or a
    pointer lost by hand or by a copy), the newest complete step folder (:func:`newest_complete`),
    marked ``named=False``: a step folder is renamed into place only once complete, so it is
    never discarded for want of a pointer. A damaged ``latest`` is refused."""
    root = Path(run_dir) / ROOT
    pointer = root / LATEST
    if not pointer.is_file() and not pointer.is_symlink():
        return newest_complete(run_dir)
    try:
        doc = json.loads(pointer.read_text())
        step, folder = int(doc["step"]), str(doc["folder"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{pointer} is not a checkpoint pointer ({exc})", field="checkpoints/latest",
                         value=str(pointer), fix="restore the file, or point it at a complete step folder: "
                                                 '{"step": N, "folder": "step-0000000N"}') from exc
    path = root / folder
    state = path / TRAINER_STATE
    if not state.is_file():
        raise InputError(f"checkpoints/latest names {folder} (step {step}), which is not a complete checkpoint",
                         field="checkpoints/latest", value=str(pointer),
                         fix="the run directory was changed by hand; restore the step folder it names")
    from muse_stack.util.safeio import read_json

    fix = "the checkpoint is damaged; restore it, or start the run again"
    saved = read_json(state, field="--resume", fix=fix, what="trainer state")
    if saved.get("step") != step:
        raise InputError(f"{state} says step {saved.get('step')!r}, not step {step} that checkpoints/latest names: "
                         "not a step of this run's checkpoint", field="--resume",
                         value=str(state), fix=fix)
    return Checkpoint(step, path)


def newest_complete(run_dir: Path) -> Checkpoint | None:
    """The newest ``step-N`` folder holding its ``trainer_state.json`` (written last, before the
    folder's rename), checked as ``latest`` checks the folder it names; None when there is none."""
    for candidate in reversed(step_folders(run_dir)):
        state = candidate.path / TRAINER_STATE
        if not state.is_file():
            continue
        from muse_stack.util.safeio import read_json

        saved = read_json(state, field="--resume", what="trainer state",
                          fix="the checkpoint is damaged; restore it, or remove its step folder to resume from "
                              "an earlier one")
        if saved.get("step") != candidate.step:
            raise InputError(f"{state} says step {saved.get('step')!r}, not step {candidate.step} that its folder "
                             "names: not a step of this run's checkpoint", field="--resume", value=str(state),
                             fix="restore the step folder, or remove it to resume from an earlier one")
        return Checkpoint(candidate.step, candidate.path, named=False)
    return None


def step_folders(run_dir: Path) -> list[Checkpoint]:
    root = Path(run_dir) / ROOT
    if not root.is_dir():
        return []
    found = [Checkpoint(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found, key=lambda c: c.step)


def out_of_space(run_dir: Path, exc: BaseException, last_step: int | None) -> CheckpointError:
    """The error for a run whose file system filled up while it wrote (a checkpoint, metrics,
    results): what failed, the free space left, and that the latest checkpoint is intact."""
    root = Path(run_dir) / ROOT
    target = root
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        room = f"; {_size(shutil.disk_usage(target).free)} free on {target}"
    except OSError:
        room = ""
    cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    before = f"step {last_step}" if last_step is not None else "none yet"
    return CheckpointError(f"the run's file system is full: a write into the run directory failed ({cause}{where}"
                           f"{room}); the latest complete checkpoint is intact ({before})",
                           field="checkpoints", value=str(root),
                           fix="free space (or fix the file system), then continue with "
                               f"`muse-stack run --resume {run_dir}`")


def checkpoint_step(directory: Path, total_steps: int) -> int:
    """The step a run checkpoint was saved after, from its trainer_state.json; a missing, truncated
    or out-of-range state is an InputError, never a traceback or a loop over a bogus count."""
    from muse_stack.util.safeio import read_json

    fix = "the checkpoint is truncated or corrupt; start a new run (the run directory keeps its metrics)"
    state = read_json(Path(directory) / TRAINER_STATE, field="--resume", what="trainer state", fix=fix)
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= total_steps:
        raise InputError(f"trainer_state.json holds step {step!r}, not a step of this run (0-{total_steps})",
                         field="--resume", value=str(directory), fix=fix)
    return step


# ---- each rank's share of the run's state ---------------------------------------------------------
#: the folder of a step folder that holds one file per rank: {component name: its state}
RANK_DIR = "rng"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / RANK_DIR / f"rank-{rank:05d}.pt"


def save_rank_state(directory: Path, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's state (its random generators, the data position) into the step folder."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    atomic.write_bytes(rank_file(directory, rank), buf.getvalue())


def load_rank_state(directory: Path, rank: int) -> dict[str, Any] | None:
    """One rank's saved state; None when the folder has none for this rank (written before
    checkpoints held it, or by fewer ranks). A file that does not load is a corrupt checkpoint."""
    import torch

    from muse_stack.engines.base import corrupt_checkpoint
    from muse_stack.run.rng import is_full_state

    file = rank_file(directory, rank)
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not (isinstance(state, dict) and is_full_state(state.get("rng"))):
            raise TypeError(f"{file.name} holds no random state")
        return state
    except Exception as exc:  # the zip reader's and the unpickler's own errors included
        raise corrupt_checkpoint(file.parent.parent, f"random state and data position ({RANK_DIR}/{file.name})",
                                 exc) from exc


#: where the reference engine's checkpoints kept the run's state before it was saved per rank
LEGACY_STATE = "optimizer.pt"


def legacy_rank_state(directory: Path, rank: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """This rank's state and the shared one, as checkpoints written before ``rng/`` held them: the
    reference engine's ``optimizer.pt`` held every rank's random state (a list; older still, torch's
    CPU state alone) and the data position (older still, none). A folder without that file (the
    megatron engine's before it saved them) holds neither: (None, None)."""
    import torch

    from muse_stack.engines.base import corrupt_checkpoint
    from muse_stack.run.rng import is_full_state

    file = Path(directory) / LEGACY_STATE
    if not file.is_file():
        return None, None
    try:  # weights_only: a checkpoint is data, never code to unpickle
        saved = torch.load(file, map_location="cpu", weights_only=True)
        rng, position = saved["rng"], saved.get("data")
    except Exception as exc:  # the zip reader's and the unpickler's own errors included
        raise corrupt_checkpoint(directory, f"random state ({RANK_DIR}/, else {LEGACY_STATE})", exc) from exc
    if torch.is_tensor(rng):
        mine = rng
    elif isinstance(rng, list) and rng and all(is_full_state(r) for r in rng):
        mine = rng[rank] if rank < len(rng) else None
        if mine is None:  # more ranks than were saved (a run continued on more processes): seeded as at the start
            log.warning("rank %d has no saved random state (the checkpoint has %d ranks); it keeps its seeded one",
                        rank, len(rng))
    else:
        raise corrupt_checkpoint(directory, f"random state ({LEGACY_STATE})", TypeError(type(rng).__name__))
    return {"rng": mine, "data": position}, {"data": position}


class CheckpointManager:
    """Owns the step folders, the interval, keep-last-N and the async wait points.

    The engine only writes and reads its own state in the folder it is given
    (:meth:`Engine.save` / :meth:`Engine.load`); the run's components (``states``) are saved
    and loaded here, per rank, whatever the engine.
    """

    def __init__(self, run_dir: Path, engine: Any, *, interval: int | None, keep: int | None,
                 rank: int = 0, final: bool = True, states: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / ROOT
        self.engine = engine
        self.interval = interval
        self.keep = keep
        self.final = final
        self.rank, self.rank0 = rank, rank == 0
        #: this rank's share of the run's own state, by name: objects with ``state_dict()`` and
        #: ``load_state_dict(state)`` (and optionally ``no_state(step)`` for a checkpoint that holds
        #: none, and ``shared = True`` when every rank holds the same state)
        self.states = dict(states or {})
        self.last_step: int | None = None  #: step of the newest complete checkpoint
        self._pending: tuple[Path, int, dict[str, str], dict[str, Any]] | None = None
        #: per save: its step, the seconds the training loop waited for it (blocking_s) and the
        #: seconds until the folder was complete (complete_s; later than blocking_s when async)
        self.saves: list[dict[str, Any]] = []
        self._started: float = 0.0
        #: bytes one checkpoint needs (the engine's estimate, measured once: the state's shapes do
        #: not change during a run); None until :meth:`check_space` or for an engine without one
        self.needed_bytes: int | None = None
        current = latest(self.run_dir)
        if current is not None:
            self.last_step = current.step

    # -- decisions ------------------------------------------------------------------------
    def due(self, step: int, total: int) -> bool:
        """A save at this step: on the interval, and at the last step (unless ``final`` is off)."""
        if step == self.last_step:
            return False
        return (self.final and step >= total) or bool(self.interval and step % self.interval == 0)

    def will_save(self, total: int) -> bool:
        """Whether this run writes any checkpoint before it ends (final, or on the interval)."""
        return self.final or bool(self.interval and self.interval <= total)

    # -- free space -----------------------------------------------------------------------
    def _free(self) -> tuple[Path, int]:
        """The nearest existing folder on the checkpoints' path and its file system's free bytes."""
        target = self.root
        while not target.exists() and target != target.parent:
            target = target.parent
        return target, shutil.disk_usage(target).free

    def check_space(self, step: int | None = None) -> None:
        """Refuse, before anything is written, a checkpoint the file system cannot hold: at
        setup (``step`` None: every rank, the engine's estimate is a collective) and before each
        save. Rank 0's file system decides (the run directory it writes to), for every rank."""
        if self.needed_bytes is None:
            estimate = getattr(self.engine, "checkpoint_bytes", None)
            if estimate is None:
                return
            self.needed_bytes = int(estimate())
        verdict = None
        if self.rank0:
            target, free = self._free()
            if free < SPACE_MARGIN * self.needed_bytes:
                what = f"the checkpoint at step {step}" if step is not None else "each checkpoint of this run"
                verdict = (f"{what} needs about {_size(self.needed_bytes)}, but the file system of "
                           f"{target} has {_size(free)} free")
        verdict = dist.broadcast(verdict)
        if verdict is not None:
            before = f"step {self.last_step}" if self.last_step is not None else "none"
            raise CheckpointError(verdict + (f"; the latest complete checkpoint is intact ({before})"
                                             if step is not None else ""),
                                  field="checkpoints", value=str(self.root),
                                  fix="free space there, or give the run a larger file system (--out); a "
                                      "throughput run that keeps no checkpoint: training.final_checkpoint=false")

    # -- resume ---------------------------------------------------------------------------
    def discard_untrusted(self) -> None:
        """Remove what ``latest`` does not vouch for: partial folders, newer step folders and the
        staging entries of a writer that was killed."""
        if not self.rank0 or not self.root.is_dir():
            return
        self.discard_staging()
        current = latest(self.run_dir)
        if current is not None and not current.named:  # the pointer written again before anything else
            log.warning("checkpoints/latest is missing: resuming from %s, the newest complete checkpoint",
                        current.path)
            pointer = {"step": current.step, "folder": current.path.name}
            atomic.write_text(self.root / LATEST, json.dumps(pointer) + "\n")
            _fsync_dir(self.root)
        for entry in self.root.iterdir():
            m = _STEP.match(entry.name)
            stale = entry.name.endswith(".partial") or (m is not None and (self.last_step is None
                                                                            or int(m.group(1)) > self.last_step))
            if stale and entry.is_dir():
                log.warning("discarding %s: not named by checkpoints/latest", entry)
                shutil.rmtree(entry)

    def discard_staging(self) -> None:
        """Remove the hidden staging entries a killed save left (see the module doc); rank 0,
        while no save is in flight."""
        if not self.rank0 or not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if not _STAGING.match(entry.name):
                continue
            log.warning("discarding %s: left by a save that did not finish", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def load(self, total_steps: int) -> int:
        """Load the latest checkpoint into the engine and the run's components; returns its step
        (0 when there is none)."""
        current = latest(self.run_dir)
        if current is None:
            return 0
        step = checkpoint_step(current.path, total_steps)
        self.engine.load(current.path)
        self._load_states(current.path, step)
        return step

    def _load_states(self, directory: Path, step: int) -> None:
        """Each component's saved state for this rank. A rank the checkpoint has no file for (a
        run continued on more processes) keeps its seeded generators and takes a shared state
        (the data position) from rank 0's file; a checkpoint written before they were saved per
        rank is read as it was written (:func:`legacy_rank_state`)."""
        if not self.states:
            return
        mine = shared = load_rank_state(directory, self.rank)
        if mine is None:
            if (directory / RANK_DIR).is_dir():  # more ranks than were saved (continued on more processes)
                log.warning("rank %d has no saved random state in %s; it keeps its seeded one", self.rank, directory)
                shared = load_rank_state(directory, 0)
            else:
                mine, shared = legacy_rank_state(directory, self.rank)
        for name, component in self.states.items():
            state = (mine or {}).get(name)
            if state is None and getattr(component, "shared", False):
                state = (shared or {}).get(name)
            if state is not None:
                component.load_state_dict(state)
            elif hasattr(component, "no_state"):
                component.no_state(step)

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, files: dict[str, str]) -> None:
        """Save the engine's state at ``step`` with the trainer's ``files`` (name -> text)."""
        self.wait()
        self.check_space(step)
        self._started = time.perf_counter()
        tmp = self.root / f"{folder_name(step)}.partial"
        try:
            if self.rank0:
                self.discard_staging()
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            dist.barrier()
            # the run's state as the step left it, written beside the trainer's files once the
            # engine's save is complete (the reference engine replaces the folder as it writes)
            states = {name: c.state_dict() for name, c in self.states.items()}
            self.engine.save(tmp, step)
        except BaseException as exc:
            self._abandon(tmp)
            raise self._error(step, exc) from exc
        self._pending = (tmp, step, files, states)
        entry: dict[str, Any] = {"step": step, "background": False}
        self.saves.append(entry)
        if self._engine_done(blocking=False):
            self._commit()
        else:
            entry["background"] = True
            log.info("checkpoint at step %d: writing in the background", step)
        entry["blocking_s"] = time.perf_counter() - self._started

    def poll(self) -> None:
        """At a step boundary: complete a background save that has finished."""
        if self._pending is not None and self._engine_done(blocking=False):
            self._commit()

    def wait(self) -> None:
        """Complete a background save, waiting for it (before the next save and at exit)."""
        if self._pending is not None:
            self._engine_done(blocking=True)
            self._commit()

    def _engine_done(self, blocking: bool) -> bool:
        finalize = getattr(self.engine, "finalize_save", None)
        if finalize is None:
            return True
        try:
            return bool(finalize(blocking))
        except BaseException as exc:
            tmp, step = self._pending[:2] if self._pending else (None, 0)
            self._pending = None
            if tmp is not None:
                self._abandon(tmp)
            raise self._error(step, exc) from exc

    def _commit(self) -> None:
        assert self._pending is not None
        tmp, step, files, states = self._pending
        self._pending = None
        final = self.root / folder_name(step)
        try:
            if states:
                save_rank_state(tmp, self.rank, states)
            dist.barrier()
            if self.rank0:
                faults.slow_save()
                faults.point("save-engine", step)
                for name, text in files.items():
                    atomic.write_text(tmp / name, text)
                atomic.write_text(tmp / TRAINER_STATE, json.dumps({"step": step}) + "\n")
                atomic.follow_umask(tmp)  # the engines' writers (safetensors, torch) keep some files 0600
                _fsync_dir(tmp)
                if final.exists():  # an earlier attempt at this step that latest never named
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _fsync_dir(self.root)
                faults.point("save-renamed", step)
                atomic.write_text(self.root / LATEST, json.dumps({"step": step, "folder": final.name}) + "\n")
                _fsync_dir(self.root)
                faults.point("save-pointed", step)
            dist.barrier()
        except BaseException as exc:
            self._abandon(tmp)
            raise self._error(step, exc) from exc
        self.last_step = step
        complete = time.perf_counter() - self._started
        self.saves[-1]["complete_s"] = complete
        log.info("checkpoint at step %d: %s (%.2f s)", step, final, complete)
        self._prune()

    def _prune(self) -> None:
        if not self.rank0 or not self.keep:
            return
        complete = [c for c in step_folders(self.run_dir) if self.last_step is not None and c.step <= self.last_step]
        for old in complete[:-self.keep]:
            shutil.rmtree(old.path, ignore_errors=True)

    def _abandon(self, tmp: Path) -> None:
        if self.rank0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _error(self, step: int, exc: BaseException) -> BaseException:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, MuseStackError)) or not isinstance(exc, Exception):
            return exc
        before = f"step {self.last_step}" if self.last_step is not None else "none yet"
        if isinstance(exc, OSError) and exc.strerror:
            cause = exc.strerror
        else:
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        try:  # what the file system had left: a writer process that dies mid-write (out of space, killed)
            target, free = self._free()  # reaches the parent as an EOFError, not as an OSError
            room = f", with {_size(free)} free on {target}" + (
                f" for about {_size(self.needed_bytes)}" if self.needed_bytes else "")
        except OSError:
            room = ""
        return CheckpointError(f"the checkpoint at step {step} could not be written ({cause}{room}); "
                               f"the latest complete checkpoint is intact ({before})",
                               field="checkpoints", value=str(self.root),
                               fix="free space (or fix the file system), then continue with "
                                   f"`muse-stack run --resume {self.run_dir}`")
