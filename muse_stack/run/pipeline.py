"""The run pipeline: validate and plan, build data, fingerprint, train, write results.

Bad input fails before anything is written. Once the run directory exists it always ends
with a results.json whose status is completed, interrupted (SIGINT/SIGTERM: the last
finished step's checkpoint is saved and ``--resume`` continues it) or failed.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from muse_stack import atomic
from muse_stack.engines import TrainContext, get_engine
from muse_stack.engines.support import check_recipe
from muse_stack.errors import InputError, LayoutError, MuseStackError, UsageError
from muse_stack.recipes.catalogue import load_recipe, parse_recipe, recipe_sha256
from muse_stack.recipes.schema import Recipe
from muse_stack.run import dist, rundir
from muse_stack.run.results import summarise

console = Console(stderr=True)
log = logging.getLogger("muse_stack.run")


@dataclass
class RunOutcome:
    path: Path
    status: str
    results: dict[str, Any]


class _Stop:
    """Turns SIGINT/SIGTERM into a flag the training loop reads after each step."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name

    @contextmanager
    def installed(self) -> Iterator["_Stop"]:
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in old:
            signal.signal(s, self)
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _total_steps(recipe: Recipe, data) -> int:
    if recipe.training.steps:
        return recipe.training.steps
    per_step = recipe.batch.gbs or 1
    return max(1, int((recipe.training.epochs or 1) * data.num_rows // per_step))


def _warmup(recipe: Recipe, total: int) -> int:
    if recipe.training.measure_warmup_steps is not None:
        return min(recipe.training.measure_warmup_steps, max(total - 1, 0))
    return min(max(1, total // 10), max(total - 1, 0))


def prepare(name: str, overrides: list[str], steps: int | None, gpus: int | None) -> Recipe:
    """Resolve and validate a recipe for a run; raises before anything is written."""
    from muse_stack.plan.planner import make_plan

    from muse_stack.recipes.schema import MAX_GPUS

    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise UsageError("the GPU count is out of range", field="--gpus", value=gpus, rule=f"1 to {MAX_GPUS:,}",
                         fix="give --gpus 1 or more (or leave it out for the recipe's hardware.count)")
    extra = list(overrides)
    if steps is not None:
        extra.append(f"training.steps={steps}")
    if gpus is not None:
        extra.append(f"hardware.count={gpus}")
    recipe = load_recipe(name, extra)
    plan, _ = make_plan(recipe)
    check_recipe(recipe)  # what the engine would refuse or not train as written, before any output
    if plan.fits is False:
        raise LayoutError(
            f"the plan does not fit: {plan.peak_memory_gib:.1f} GiB estimated on stage {plan.peak_stage} "
            f"of {plan.gpu_memory_gib:.1f} GiB per {plan.gpu}", field="layout", value=recipe.layout.model_dump(),
            rule="estimated peak memory within the GPU's memory less headroom",
            fix=f"see `muse-stack plan {name}`: raise EP or PP, turn on full recompute, or use more GPUs")
    return recipe


def _setup_logging(path: Path, rank: int) -> logging.Handler | None:
    if rank != 0:
        return None
    handler = logging.FileHandler(path / rundir.LOG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("muse_stack")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def run(name: str | None = None, *, overrides: list[str] | None = None, out: str | Path | None = None,
        steps: int | None = None, gpus: int | None = None, resume: str | Path | None = None,
        pretrained_checkpoint: str | None = None, progress: bool = True, base_dir: str | Path = "runs",
        stop_after: int | None = None) -> RunOutcome:
    """Run a recipe end to end. ``stop_after`` interrupts after that many steps (for tests)."""
    env = dist.from_environment()
    resumed_step = 0
    if resume is not None:
        record = rundir.read_run(resume)
        status = (record.results or {}).get("status")
        if status != "interrupted":
            raise InputError(f"only an interrupted run can be resumed (this one is {status or 'unfinished'})",
                             field="--resume", value=str(resume), fix="start a new run instead")
        if not (record.path / rundir.CHECKPOINT).is_dir():
            raise InputError("the interrupted run has no checkpoint", field="--resume", value=str(resume),
                             fix="start a new run instead")
        recipe = record.recipe
        path = record.path
    else:
        if name is None:
            raise InputError("no recipe given", field="recipe", value=None, fix="muse-stack run RECIPE")
        recipe = prepare(name, overrides or [], steps, gpus)
        if recipe.hardware.gpu == "cpu" and env.world_size != recipe.hardware.count and env.world_size > 1:
            recipe = parse_recipe({**recipe.model_dump(mode="json"),
                                   "hardware": {**recipe.hardware.model_dump(), "count": env.world_size}}, name)
        if env.world_size != recipe.hardware.count:
            raise LayoutError("the processes launched do not match the recipe's GPUs", field="hardware.count",
                              value=recipe.hardware.count,
                              rule=f"one process per GPU: {env.world_size} launched",
                              fix=f"launch {recipe.hardware.count} processes (torchrun --nproc-per-node ...) "
                                  f"or pass --gpus {env.world_size}")
        get_engine(recipe.engine)  # fail early, before any output, when the engine cannot run here
        path = Path(out) if out is not None else None
        if path is not None and path.exists() and env.rank == 0:  # the other ranks may start after rank 0 made it
            raise InputError("the run directory already exists; a run never overwrites another", field="--out",
                             value=str(path), fix="choose a new --out path (or omit it for a fresh one), "
                                                   "or continue an interrupted run with --resume")
    dist.init(env, recipe.hardware.gpu != "cpu")
    try:
        return _run(recipe, path, env, resume is not None, pretrained_checkpoint, progress, base_dir, stop_after,
                    resumed_step)
    finally:
        dist.shutdown()


def _run(recipe: Recipe, path: Path | None, env: "dist.DistEnv", resuming: bool, pretrained: str | None,
         progress: bool, base_dir: str | Path, stop_after: int | None, resumed_step: int) -> RunOutcome:
    from muse_stack.data import build_for_recipe
    from muse_stack.fingerprint import capture, merge_ranks
    from muse_stack.run.peak import peak_for
    from muse_stack.run.plots import loss_plot, throughput_plot

    rank0 = env.rank == 0
    if not resuming:
        if rank0:
            path = rundir.create(path or rundir.default_run_dir(recipe.name, base_dir), recipe)
        path = Path(dist.broadcast(str(path) if path else None))
    assert path is not None
    handler = _setup_logging(path, env.rank)
    started = time.time()
    metrics_file = path / rundir.METRICS
    metrics: list[dict[str, Any]] = rundir.read_metrics(path) if resuming else []
    status, error = "failed", None
    results: dict[str, Any] = {}
    engine = None
    rank_peaks: list[float | None] | None = None
    model_cfg = recipe.model_config_resolved()
    prior_wall = 0.0
    if resuming:
        prior = json.loads((path / rundir.RESULTS).read_text())
        prior_wall = float(prior.get("wall_seconds") or 0.0)
    peak_tflops, peak_source = None, "not measured"
    try:
        # data: rank 0 builds (cached), the others open the same build
        if rank0:
            data = build_for_recipe(recipe, progress=progress and rank0)
        dist.barrier()
        if not rank0:
            data = build_for_recipe(recipe, progress=False)
        total = _total_steps(recipe, data)
        log.info("recipe %s: %d steps, data %s (%d rows, rows_sha256 %s)", recipe.name, total, data.path,
                 data.num_rows, data.rows_sha256)

        ctx = TrainContext(recipe=recipe, model=model_cfg, data=data, total_steps=total, rank=env.rank,
                           world_size=env.world_size, local_rank=env.local_rank,
                           pretrained_checkpoint=pretrained or recipe.model.pretrained_checkpoint)
        engine = get_engine(recipe.engine)(ctx)
        if resuming:
            resumed_step = engine.load(path / rundir.CHECKPOINT)
            metrics = metrics[:resumed_step]
            if rank0:
                atomic.write_text(metrics_file, "".join(json.dumps(m) + "\n" for m in metrics))
            log.info("resumed at step %d", resumed_step)

        # fingerprint: every rank captures its own, rank 0 records whether they agree
        fp = capture(recipe_sha256=recipe_sha256(recipe), rows_sha256=data.rows_sha256,
                     extra={"recipe": recipe.name, "engine": engine.describe()})
        all_fps = dist.gather(fp)
        if rank0:
            if env.world_size > 1:
                for r, doc in enumerate(all_fps):
                    atomic.write_json(path / rundir.RANKS / f"rank-{r}.json", doc)
                fp = merge_ranks(all_fps)
            name = "fingerprint.resumed.json" if resuming else rundir.FINGERPRINT
            atomic.write_json(path / name, fp)
            peak_tflops, peak_source = peak_for(recipe.hardware.gpu)
            log.info("peak %s TFLOP/s (%s)", peak_tflops, peak_source)

        stop = _Stop()
        first = resumed_step + 1
        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                       console=console, disable=not (progress and rank0), transient=False)
        with stop.installed(), bar:
            task = bar.add_task(recipe.name, total=total, completed=resumed_step, loss="-")
            for step in range(first, total + 1):
                t0 = time.perf_counter()
                stats = engine.train_step(step)
                dt = time.perf_counter() - t0
                row = {"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                       "step_time_s": dt, "tokens": stats.tokens, "supervised_tokens": stats.supervised_tokens,
                       "tokens_per_s": stats.tokens / dt, "tokens_per_s_per_gpu": stats.tokens / dt / env.world_size,
                       "peak_memory_gib": engine.peak_memory_gib()}
                metrics.append(row)
                if rank0:
                    atomic.append_line(metrics_file, json.dumps(row))
                    log.info("step %d loss %.4f grad_norm %.3f lr %.3g %.3fs", step, stats.loss, stats.grad_norm,
                             stats.lr, dt)
                bar.update(task, advance=1, loss=f"{stats.loss:.4f}")
                if stop_after is not None and step >= stop_after:
                    stop.signal = "stop_after"
                if dist.any_flag(stop.signal is not None):
                    break
        # every rank's peak (pipeline stages and expert ranks differ; the metrics carry rank 0's)
        rank_peaks = dist.gather(engine.peak_memory_gib())
        if len(metrics) >= total:
            status = "completed"
        else:
            status = "interrupted"
            engine.save(path / rundir.CHECKPOINT, len(metrics))
            log.warning("interrupted (%s) after step %d; checkpoint saved", stop.signal, len(metrics))
    except MuseStackError as exc:
        error = exc.render()
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KeyboardInterrupt) and engine is not None and metrics:
            status = "interrupted"
            engine.save(path / rundir.CHECKPOINT, len(metrics))
        raise
    finally:
        if rank0:
            warm = _warmup(recipe, recipe.training.steps or len(metrics) or 1)
            engine_name = engine.name if engine is not None else recipe.engine
            device = engine.device if engine is not None else "unknown"
            seq = engine.seq_lens() if engine is not None else [recipe.batch.seq_length or 1]
            if peak_tflops is None and status != "failed":
                peak_tflops, peak_source = peak_for(recipe.hardware.gpu)
            results = summarise(metrics, model=model_cfg, world_size=env.world_size, seq_lens=seq, warmup=warm,
                                peak_tflops=peak_tflops, peak_source=peak_source,
                                price_per_gpu_hour=recipe.hardware.price_per_gpu_hour,
                                wall_seconds=prior_wall + time.time() - started, status=status, device=device,
                                engine=engine_name)
            results["recipe"] = recipe.name
            if rank_peaks is not None and env.world_size > 1:
                results["peak_memory_gib_by_rank"] = rank_peaks
            if engine is not None:
                results["engine_info"] = engine.describe()
            results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            if error:
                results["error"] = error
            if resuming:
                results["resumed_at_step"] = resumed_step
            atomic.write_json(path / rundir.RESULTS, results)
            if metrics:
                loss_plot(metrics, path / "loss.png", f"{recipe.name}: loss")
                throughput_plot(metrics, path / "throughput.png", f"{recipe.name}: tokens/s per GPU",
                                results.get("window"))
            log.info("status %s; results in %s", status, path / rundir.RESULTS)
        if handler is not None:
            logging.getLogger("muse_stack").removeHandler(handler)
            handler.close()
    return RunOutcome(path=path, status=status, results=results)
