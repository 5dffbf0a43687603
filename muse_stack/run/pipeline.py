"""The run pipeline: validate and plan, then hand the run to :class:`~muse_stack.run.trainer.Trainer`.

Bad input fails before anything is written. Once the run directory exists it is locked for
this process (:mod:`muse_stack.run.dirlock`) and always ends with a results.json whose status
is completed, interrupted (SIGINT/SIGTERM, caught from the first line: the last finished
step is checkpointed), diverged (a non-finite loss) or failed; a process killed outright
leaves its latest complete checkpoint, and ``--resume`` continues from it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from muse_stack.engines import get_engine
from muse_stack.util.errors import InputError, LayoutError, RecipeError, UsageError
from muse_stack.recipes.catalogue import load_recipe, parse_recipe
from muse_stack.resolve.recipe import ResolvedRecipe, finalize, resolve
from muse_stack.recipes.schema import REQUIRED_PATH, Recipe
from muse_stack.run import dist
from muse_stack.run import rundir
from muse_stack.run.inputs import check_inputs
from muse_stack.run.dirlock import RunLock
from muse_stack.run.signals import StopFlag
from muse_stack.run.trainer import RunOutcome, Trainer

__all__ = ["RunOutcome", "prepare", "run"]


def prepare(name: str, overrides: list[str], steps: int | None, gpus: int | None) -> ResolvedRecipe:
    """Resolve and validate a recipe for a run; raises before anything is written."""
    return check_runnable(load_recipe(name, _extra(overrides, steps, gpus)), name)


def check_runnable(recipe: Recipe, name: str) -> ResolvedRecipe:
    """The recipe resolved: the plan fits and the engine trains it as written; raises otherwise."""
    from muse_stack.plan.planner import make_plan

    resolved = finalize(recipe)
    plan, _ = make_plan(resolved)
    resolved.validate()  # what the engine would refuse or not train as written, before any output
    _check_vocab(resolved)
    if plan.fits is False:
        raise LayoutError(
            f"the plan does not fit: {plan.peak_memory_gib:.1f} GiB estimated on stage {plan.peak_stage} "
            f"of {plan.gpu_memory_gib:.1f} GiB per {plan.gpu}", field="layout", value=recipe.layout.model_dump(),
            rule="estimated peak memory within the GPU's memory less headroom",
            fix=f"see `muse-stack plan {name}`: raise EP or PP, turn on full recompute, or use more GPUs")
    from muse_stack.plan.save import fill_interval

    fill_interval(resolved.recipe, plan)  # several nodes and no interval stated: the periodic save's default
    return resolved


def _check_vocab(resolved: ResolvedRecipe) -> None:
    """The model's embedding holds every id the recipe's tokenizer gives (a smaller vocab_size
    would index past the embedding at the first step)."""
    from muse_stack.data.build import plan_for_recipe

    recipe = resolved.recipe

    if recipe.data.kind in ("synthetic", "multimodal"):
        return  # synthetic ids come from the model's vocabulary; image-text rows are not built here
    from muse_stack.util.errors import MuseStackError

    try:
        data = plan_for_recipe(recipe, require_tokenizer=False)
    except MuseStackError:
        return  # what the data plan lacks is the data build's error, reported where the rows are built
    if data.tokenizer_dir is None:
        return  # a missing tokenizer is the data build's error
    from muse_stack.data.chat import ChatTokenizer

    ids = ChatTokenizer(data.tokenizer_dir).vocab_size
    vocab = resolved.model.vocab_size
    if vocab < ids:
        raise RecipeError(f"the model's vocabulary ({vocab:,}) is smaller than the tokenizer's ({ids:,} ids, "
                          f"{data.tokenizer_dir})", field="model.vocab_size", value=vocab,
                          rule="vocab_size at least the tokenizer's vocabulary size (added tokens included)",
                          fix=f"set model.overrides.vocab_size={ids} or more (a multiple of 128 pads it for GPUs), "
                              "or use the model's own tokenizer")


def _with_start(recipe: Recipe, pretrained: str | None) -> Recipe:
    """The checkpoint the run starts from, recorded in the recipe (``--pretrained-checkpoint``
    is ``model.pretrained_checkpoint``), and refused when the recipe requires one not given."""
    if pretrained is not None:
        from muse_stack.util.safeio import refuse_secrets

        refuse_secrets(str(pretrained), field="--pretrained-checkpoint", error=UsageError, what="the path")
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(
            update={"pretrained_checkpoint": str(pretrained)})})
    if recipe.model.pretrained_checkpoint == REQUIRED_PATH:
        note = recipe.notes.get("model.pretrained_checkpoint", "")
        raise RecipeError(f"this recipe starts from a checkpoint you supply{': ' + note if note else ''}",
                          field="model.pretrained_checkpoint", value=REQUIRED_PATH,
                          fix="pass --pretrained-checkpoint DIR (a local HF-style copy of that checkpoint)")
    return recipe


def _extra(overrides: list[str] | None, steps: int | None, gpus: int | None) -> list[str]:
    from muse_stack.recipes.schema import MAX_GPUS

    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise UsageError("the GPU count is out of range", field="--gpus", value=gpus, rule=f"1 to {MAX_GPUS:,}",
                         fix="give --gpus 1 or more (or leave it out for the recipe's hardware.count)")
    extra = list(overrides or [])
    if steps is not None:
        extra.append(f"training.steps={steps}")
    if gpus is not None:
        extra.append(f"hardware.count={gpus}")
    return extra


def _new_recipe(name: str, overrides: list[str] | None, steps: int | None, gpus: int | None,
                pretrained_checkpoint: str | None, env: "dist.DistEnv") -> ResolvedRecipe:
    """The recipe a new run trains, resolved and checked: plan, engine, process count, loggers (the
    checkpoint it starts from is checked by the caller: a resume takes its weights from its own
    checkpoint)."""
    resolved = prepare(name, overrides or [], steps, gpus)
    # the checkpoint it starts from: nothing is derived from it
    resolved = dataclasses.replace(resolved, recipe=_with_start(resolved.recipe, pretrained_checkpoint))
    recipe = resolved.recipe
    if recipe.hardware.gpu == "cpu" and env.world_size != recipe.hardware.count and env.world_size > 1:
        recipe = parse_recipe({**recipe.model_dump(mode="json"),
                               "hardware": {**recipe.hardware.model_dump(), "count": env.world_size}}, name)
        resolved = resolve(recipe)  # the micro-batches per step follow the processes
    if env.world_size != recipe.hardware.count:
        raise LayoutError("the processes launched do not match the recipe's GPUs", field="hardware.count",
                          value=recipe.hardware.count,
                          rule=f"one process per GPU: {env.world_size} launched",
                          fix=f"launch {recipe.hardware.count} processes (torchrun --nproc-per-node ..., or srun "
                              f"with one task per GPU: --ntasks {recipe.hardware.count}) or pass --gpus "
                              f"{env.world_size}")
    get_engine(recipe.engine)  # fail early, before any output, when the engine cannot run here
    check_inputs(recipe, start=False)  # W&B importable: before the run directory exists
    return resolved


def _locked_by_another(path: Path) -> str | None:
    """The pid holding the run directory's lock, read without taking it (a dry run writes nothing)."""
    import fcntl
    import os

    from muse_stack.run.dirlock import LOCK

    try:
        fd = os.open(path / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def run(name: str | None = None, *, overrides: list[str] | None = None, out: str | Path | None = None,
        steps: int | None = None, gpus: int | None = None, resume: str | Path | None = None,
        pretrained_checkpoint: str | None = None, progress: bool = True, base_dir: str | Path = "runs",
        stop_after: int | None = None, allow_change: bool = False, dry_run: bool = False,
        step_stream=None) -> RunOutcome:
    """Run a recipe end to end, or continue one (``resume``: a run directory, or ``"auto"`` with
    ``name`` and ``out``: resume, restart or start there, whatever the last attempt left; see
    :func:`muse_stack.run.resume.inspect_out`). ``stop_after`` interrupts after that many steps
    (the checkpoint is saved as on SIGTERM). ``dry_run``: every check, nothing written; the
    outcome's status is ``dry-run`` and its results say what the run would do."""
    from muse_stack.run import resume as resuming

    stop = StopFlag()
    with stop.installed():  # from the first line: a signal anywhere below only asks the run to stop
        env = dist.from_environment()
        lock: RunLock | None = None
        change = None
        auto = resume is not None and str(resume) == resuming.AUTO
        restart = False
        wanted: ResolvedRecipe | None = None
        if auto:
            if name is None:
                raise UsageError("--resume auto needs the recipe the run trains", field="recipe", value=None,
                                 fix="muse-stack run RECIPE --out RUN_DIR --resume auto")
            if out is None:
                raise UsageError("--resume auto needs the run directory", field="--out", value=None,
                                 fix="muse-stack run RECIPE --out RUN_DIR --resume auto")
            if allow_change:
                raise UsageError("--allow-change is for --resume DIR: a requeued job continues with the recipe "
                                 "its checkpoint was trained with", field="--allow-change", value=True,
                                 fix="drop --allow-change, or continue the run with --resume DIR --allow-change")
            wanted = _new_recipe(name, overrides, steps, gpus, pretrained_checkpoint, env)
            found = resuming.inspect_out(Path(out), wanted.recipe, auto=True)
            if found.action == "completed":  # a requeue after the end: nothing to do, nothing changed
                if dry_run:
                    return RunOutcome(path=found.path, status="dry-run", results={
                        "dry_run": True, "action": "completed", "run_dir": str(found.path),
                        "steps_completed": found.results.get("steps_completed")})
                return RunOutcome(path=found.path, status="completed",
                                  results={**found.results, "note": "the run had completed; nothing was changed"})
            if found.action == "resume":
                resume = found.path
            else:
                check_inputs(wanted.recipe)  # the checkpoint it starts from is readable
                resume, restart = None, found.action == "restart"
        elif resume is not None and name is not None:
            # RECIPE with --resume DIR: compared with the run's recipe as --resume auto compares it, so a
            # RECIPE that differs is refused (or, with --allow-change, continued with and recorded)
            wanted = _new_recipe(name, overrides, steps, gpus, pretrained_checkpoint, env)
        if resume is not None:
            from muse_stack.run.resume import plan_resume

            path = Path(resume)
            if env.rank == 0:
                if not rundir.is_run_dir(path):
                    raise rundir.not_a_run(path, "--resume")
                if dry_run:
                    holder = _locked_by_another(path)
                    if holder is not None:
                        raise InputError(f"the run directory is being written by another process (pid {holder})",
                                         field="--resume", value=str(path),
                                         fix="wait for that process to finish (or stop it) before resuming this run")
                else:
                    lock = RunLock(path, "--out" if auto else "--resume").acquire()
            try:
                extra = [] if wanted is not None else _extra(overrides, steps, gpus)
                if pretrained_checkpoint is not None and wanted is None:
                    extra.append(f"model.pretrained_checkpoint={json.dumps(str(pretrained_checkpoint))}")
                plan = plan_resume(path, extra, allow_change, wanted=wanted.recipe if wanted else None)
                recipe, change = plan.recipe, plan.change
                if plan.checkpoint is not None and not plan.checkpoint.named and env.rank == 0:
                    from muse_stack.run.trainer import console

                    console.print(f"checkpoints/latest is missing in {path}: "
                                  f"{'would resume' if dry_run else 'resuming'} from step {plan.checkpoint.step}, "
                                  f"the newest complete checkpoint ({plan.checkpoint.path.name})"
                                  + ("" if dry_run else "; the pointer is written again"),
                                  markup=False, highlight=False)
                if env.world_size != recipe.hardware.count:
                    raise LayoutError("the processes launched do not match the run's GPUs", field="hardware.count",
                                      value=recipe.hardware.count,
                                      rule=f"one process per GPU: {env.world_size} launched",
                                      fix=f"launch {recipe.hardware.count} processes, or pass --gpus "
                                          f"{env.world_size} --allow-change to continue on {env.world_size}")
                # a changed recipe is checked as a new one; the run's own was when it started
                resolved = check_runnable(recipe, str(path)) if change is not None else finalize(recipe)
                check_inputs(recipe, start=False)  # the recipe's loggers can start (W&B installed)
                # the changed recipe.yaml is written by the trainer once the checkpoint has loaded
            except BaseException:
                if lock is not None:
                    lock.release()
                raise
            if dry_run:
                return RunOutcome(path=path, status="dry-run", results={
                    "dry_run": True, "action": "resume", "run_dir": str(path),
                    "from_step": plan.checkpoint.step if plan.checkpoint is not None else 0,
                    "changes": change["fields"] if change is not None else {}})
        else:
            if name is None:
                raise InputError("no recipe given", field="recipe", value=None, fix="muse-stack run RECIPE")
            resolved = wanted or _new_recipe(name, overrides, steps, gpus, pretrained_checkpoint, env)
            recipe = resolved.recipe
            if wanted is None:
                check_inputs(recipe)  # the checkpoint it starts from is readable
            path = Path(out) if out is not None else None
            if path is not None and not auto and env.rank == 0:  # other ranks may start after rank 0 made it
                restart = resuming.inspect_out(path, recipe, auto=False).action == "restart"
            stop.check()
            if dry_run:
                where = path or rundir.default_run_dir(recipe.name, base_dir)
                if restart and _locked_by_another(where) is not None:
                    raise InputError("the run directory is being written by another process", field="--out",
                                     value=str(where), fix="wait for that process to finish (or stop it)")
                return RunOutcome(path=where, status="dry-run", results={
                    "dry_run": True, "action": "restart" if restart else "new", "run_dir": str(where),
                    "recipe": recipe.name, "steps": recipe.training.steps})
        dist.init(env, recipe.hardware.gpu != "cpu")
        try:
            if resume is None:
                if env.rank == 0:
                    if restart:  # an attempt without a checkpoint: start again in the same folder
                        lock = RunLock(path, "--out").acquire()
                        resuming.clear_outputs(path)
                        from muse_stack.util import atomic
                        from muse_stack.recipes.catalogue import recipe_yaml

                        atomic.write_text(path / rundir.RECIPE, recipe_yaml(recipe))
                        from muse_stack.run.trainer import console

                        console.print(f"restarting in {path}: the last attempt left no checkpoint", markup=False,
                                      highlight=False)
                    else:
                        path = rundir.create(path or rundir.default_run_dir(recipe.name, base_dir), recipe)
                        lock = RunLock(path, "--out").acquire()
                path = Path(dist.broadcast(str(path) if path else None))
            trainer = Trainer(resolved, path, env, stop, resuming=resume is not None, change=change, progress=progress,
                              stop_after=stop_after, step_stream=step_stream)
            return trainer.run()
        finally:
            if lock is not None:
                lock.release()
            dist.shutdown()
