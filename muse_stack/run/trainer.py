"""The training loop of a run: setup -> loop -> finish, with its components called at known points.

:class:`Trainer` holds the run's state (the last finished step, the metrics rows, the status)
and calls, in one direction:

* setup: the data rows, the engine (behind :class:`muse_stack.engines.Engine`), the step's state
  around it (:class:`~muse_stack.run.steps.TrainSteps`: the LR, the micro-batches and the data
  position, the random generators), the :class:`~muse_stack.run.checkpoints.CheckpointManager`
  (which saves and, on resume, loads the engine's state and the step's), the fingerprint, and the
  metric loggers (:mod:`muse_stack.run.sinks`);
* per step: ``TrainSteps.step`` (the LR and this rank's micro-batches into ``engine.train_step``)
  -> a metrics row -> every logger -> one decision (:meth:`Trainer._decide`): save now, stop now,
  or go on;
* finish: the last save's completion, ``results.json``, the plots.

Signals only raise a flag (:mod:`muse_stack.run.signals`), read between setup phases and
after each step; a non-finite loss ends the run as ``diverged`` at that step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from muse_stack.util import atomic
from muse_stack.engines import TrainContext, get_engine
from muse_stack.util.errors import InputError, MuseStackError
from muse_stack.recipes.catalogue import recipe_sha256, recipe_yaml
from muse_stack.resolve.recipe import ResolvedRecipe
from muse_stack.recipes.schema import Recipe
from muse_stack.run import dist
from muse_stack.run import faults, rundir
from muse_stack.run.checkpoints import CheckpointManager, out_of_space
from muse_stack.util.atomic import disk_full
from muse_stack.run.checkpoints import latest as checkpoints_latest
from muse_stack.run.signals import StopFlag, StopRequested
from muse_stack.run.steps import TrainSteps
from muse_stack.run.sinks import MetricLoggers, RunStart, loggers_for

console = Console(stderr=True)
log = logging.getLogger("muse_stack.run")
#: the keys of a step's metrics row that record its validation (recipe ``validation``), when due


@dataclass
class RunOutcome:
    path: Path
    status: str
    results: dict[str, Any]


def total_steps(recipe: Recipe, data) -> int:
    if recipe.training.steps:
        return recipe.training.steps
    per_step = recipe.batch.gbs or 1
    return max(1, int((recipe.training.epochs or 1) * data.num_rows // per_step))


def warmup_steps(recipe: Recipe, total: int) -> int:
    if recipe.training.measure_warmup_steps is not None:
        return min(recipe.training.measure_warmup_steps, max(total - 1, 0))
    return min(max(1, total // 10), max(total - 1, 0))


class Trainer:
    def __init__(self, resolved: ResolvedRecipe, path: Path, env: "dist.DistEnv", stop: StopFlag, *, resuming: bool,
                 change: dict[str, Any] | None = None, progress: bool = True,
                 stop_after: int | None = None, step_stream: Any = None) -> None:
        self.resolved = resolved  #: the recipe and what it resolves to (muse_stack.resolve.recipe)
        self.recipe, self.path, self.env, self.stop = resolved.recipe, path, env, stop
        self.step_stream = step_stream  #: where the step lines go without a progress bar (stdout)
        self.rank0 = env.rank == 0
        self.resuming, self.change = resuming, change
        self.progress, self.stop_after = progress, stop_after
        self.model_cfg = resolved.model
        # state
        self.step = 0  #: last finished step
        self.resumed_step = 0
        self.total = 0
        self.metrics: list[dict[str, Any]] = []
        self.status, self.error = "failed", None
        self.diverged_at: int | None = None
        self.engine = None
        self.steps: TrainSteps | None = None  #: the LR, the data and the random state around the engine's steps
        self.checkpoints: CheckpointManager | None = None
        #: metrics.jsonl, run.log, the progress bar or stdout line, TensorBoard / W&B: rank 0
        self.loggers = MetricLoggers([])
        self.rank_peaks: list[float | None] | None = None
        self.peak_tflops, self.peak_source = None, "not measured"
        self.changes: list[dict[str, Any]] = []
        self.setup_done = False  #: setup finished: from here on the run directory records this attempt
        self.started = time.time()
        self.prior_wall = 0.0
        self.gc = self.recipe.training.gc
        self._gc_was_enabled: bool | None = None  #: set while the run holds the collector off
        self.gc_collections: list[int] = []  #: the steps after which the run collected by hand
        self.held_out = None  #: the held-out split (muse_stack.data.split.HeldOut) when the recipe validates

    # -- the whole run --------------------------------------------------------------------
    def run(self) -> RunOutcome:
        handler = self._setup_logging()
        results: dict[str, Any] = {}
        failed = False  # an error is on its way out: a failure to write the results must not replace it
        try:
            self.setup()
            self.train()
        except StopRequested as exc:
            self.status = "interrupted"
            log.warning("%s before the first step; nothing to save", exc)
        except MuseStackError as exc:
            failed, self.error = True, exc.render()
            raise
        except OSError as exc:
            failed = True
            if not disk_full(exc):
                self.error = f"{type(exc).__name__}: {exc}"
                raise
            full = out_of_space(self.path, exc, self.checkpoints.last_step if self.checkpoints else None)
            self.error = full.render()
            raise full from exc
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised
            failed, self.error = True, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                self._gc_restore()
                results = self.finish()
            except Exception as late:
                if not failed:
                    if disk_full(late):
                        raise out_of_space(self.path, late, self.checkpoints.last_step if self.checkpoints
                                           else None) from late
                    raise
                log.error("the run's results could not be written after its error (%s: %s)",
                          type(late).__name__, late)
            finally:
                if handler is not None:
                    logging.getLogger("muse_stack").removeHandler(handler)
                    handler.close()
        return RunOutcome(path=self.path, status=self.status, results=results)

    # -- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        from muse_stack.data import build_for_recipe
        from muse_stack.machine.peak import peak_for

        faults.point("setup")
        self._check_stop()
        recipe, env = self.recipe, self.env
        if self.resuming:
            self._read_prior()
        if self.rank0:  # rank 0 builds the rows (cached), the others open the same build
            data = build_for_recipe(recipe, progress=self.progress)
        dist.barrier()
        if not self.rank0:
            data = build_for_recipe(recipe, progress=False)
        faults.point("after-data")
        self._check_stop()
        from muse_stack.data.split import split_for_recipe

        # with validation: training takes the build's rows less the held-out ones (the same on every rank)
        data, self.held_out = split_for_recipe(recipe, data)
        if self.held_out is not None:
            log.info("validation: %d held-out rows (rows_sha256 %s), loss over %d batches every %d steps and at "
                     "the end", self.held_out.num_rows, self.held_out.rows_sha256, self.held_out.eval_iters,
                     self.held_out.eval_interval)
        self.total = total_steps(recipe, data)
        log.info("recipe %s: %d steps, data %s (%d rows, rows_sha256 %s)", recipe.name, self.total, data.path,
                 data.num_rows, data.rows_sha256)
        # the weights to start from; a resumed run with a checkpoint takes them from the checkpoint,
        # but for the frozen base of an adapter run, which its checkpoints name and do not copy
        start = None if self.resuming and checkpoints_latest(self.path) is not None and recipe.peft is None \
            else recipe.model.pretrained_checkpoint
        if self.resuming and recipe.peft is not None and start and not Path(start).is_dir():
            raise InputError("the frozen base this adapter run trained on is not there: its checkpoints hold only "
                             "the adapters", field="model.pretrained_checkpoint", value=start,
                             fix="restore the base at that path, or give its new place: --pretrained-checkpoint DIR "
                                 "--allow-change (the base's hash is checked against the one recorded at the start)")
        from muse_stack.util import numerics

        self.numerics = numerics.apply(recipe)  # before the engine touches the GPU
        ctx = TrainContext(recipe=recipe, model=self.model_cfg, rank=env.rank, world_size=env.world_size,
                           local_rank=env.local_rank, pretrained_checkpoint=start,
                           resolved=self.resolved)
        self.engine = get_engine(recipe.engine)(ctx)
        self.steps = TrainSteps(self.engine, recipe, data, self.total)
        self.checkpoints = CheckpointManager(self.path, self.engine, interval=recipe.training.checkpoint_interval,
                                             keep=recipe.training.keep_checkpoints, rank=env.rank,
                                             final=recipe.training.final_checkpoint, states=self.steps.states())
        if self.checkpoints.will_save(self.total):  # a run whose checkpoints cannot fit: refused before it trains
            self.checkpoints.check_space()
        history: list[dict[str, Any]] = []
        if self.resuming:
            self.checkpoints.discard_untrusted()
            dist.barrier()
            self.resumed_step = self.step = self.checkpoints.load(self.total)
            history = self._history(self.step)
            log.info("resumed at step %d", self.step)
        self.metrics = history
        self._fingerprint(data)
        if self.rank0:
            self.peak_tflops, self.peak_source = peak_for(recipe.hardware.gpu)
            log.info("peak %s TFLOP/s (%s)", self.peak_tflops, self.peak_source)
        self.loggers = loggers_for(recipe, self.path, rank=env.rank, progress=self.progress, console=console,
                                   stream=self.step_stream,
                                   resumed_step=self.resumed_step if self.resuming else None)
        if self.loggers:
            self.loggers.open(self._run_start(history))
        self.setup_done = True
        self._gc_start()

    # -- garbage collection ---------------------------------------------------------------
    def _gc_start(self) -> None:
        """Manual collection (``training.gc.manual``): collect what setup left, freeze the
        survivors (the model, the optimizer, the data: never scanned again) and turn the
        automatic collector off, so that no collection lands inside a step."""
        import gc

        if not self.gc.manual:
            return
        self._gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        log.info("garbage collection by hand: after every %s step(s)%s", self.gc.interval or "no",
                 " and after each checkpoint save" if self.gc.eval else "")

    def _gc_collect(self, step: int) -> float:
        """One collection after ``step``; returns its seconds."""
        import gc

        t0 = time.perf_counter()
        gc.collect()
        self.gc_collections.append(step)
        return time.perf_counter() - t0

    def _gc_restore(self) -> None:
        import gc

        if self._gc_was_enabled is None:
            return
        gc.unfreeze()
        if self._gc_was_enabled:
            gc.enable()
        self._gc_was_enabled = None

    def _run_start(self, history: list[dict[str, Any]]) -> RunStart:
        """What the loggers open with: the history, the step count, the resolved recipe and the
        stack as fingerprinted."""
        recipe_text = (self.path / rundir.RECIPE).read_text() if (self.path / rundir.RECIPE).is_file() else ""
        try:
            fp = json.loads((self.path / rundir.FINGERPRINT).read_text())
            stack = {k: v.get("version") for k, v in (fp.get("frameworks") or {}).items() if isinstance(v, dict)}
            stack["python"] = (fp.get("python") or {}).get("version")
        except (OSError, ValueError, AttributeError):
            stack = {}
        return RunStart(history, self.total, recipe_text, stack,
                        resumed_step=self.resumed_step if self.resuming else None)

    def _check_stop(self) -> None:
        """Between setup phases, on every rank at once: stop when any rank was signalled."""
        if dist.any_flag(self.stop.requested):
            raise StopRequested(self.stop.signal or "a signal to another rank")

    def _read_prior(self) -> None:
        try:
            prior = json.loads((self.path / rundir.RESULTS).read_text())
            self.prior_wall = float(prior.get("wall_seconds") or 0.0)
        except (OSError, ValueError):
            self.prior_wall = 0.0  # killed before it wrote results: that time is not known

    def _history(self, step: int) -> list[dict[str, Any]]:
        """Metrics rows 1..step: the checkpoint's copy (written with it), else metrics.jsonl's."""
        if step == 0:
            return []
        current = checkpoints_latest(self.path)
        rows = current.metrics_rows() if current is not None else None
        if rows is None:
            rows = rundir.read_metrics(self.path)[:step]
        if [r.get("step") for r in rows] != list(range(1, step + 1)):
            raise InputError(f"the metrics of steps 1..{step} are not all recorded (found {len(rows)} rows)",
                             field=rundir.METRICS, value=str(self.path / rundir.METRICS),
                             fix="restore metrics.jsonl, or start a new run")
        return rows

    def _engine_info(self) -> dict[str, Any]:
        """The engine as it describes itself, and the micro-batches of each of its steps."""
        assert self.engine is not None
        info = self.engine.describe()
        if self.steps is not None:
            info["micro_batches_per_step"] = self.steps.micro_batches
        return info

    def _fingerprint(self, data) -> None:
        from muse_stack.fingerprint import capture, merge_ranks

        extra = {"recipe": self.recipe.name, "engine": self._engine_info(),
                 "numerics": {"deterministic": bool(self.recipe.numerics.deterministic),
                              "set": getattr(self, "numerics", {})}}
        if self.held_out is not None:  # rows_sha256 is then the training rows'; the held-out rows' is here
            extra["validation"] = self.held_out.describe()
        fp = capture(recipe_sha256=recipe_sha256(self.recipe), rows_sha256=data.rows_sha256, extra=extra)
        all_fps = dist.gather(fp)
        if not self.rank0:
            return
        if self.env.world_size > 1:
            for r, doc in enumerate(all_fps):
                atomic.write_json(self.path / rundir.RANKS / f"rank-{r}.json", doc)
            fp = merge_ranks(all_fps)
        main = self.path / rundir.FINGERPRINT
        if self.resuming and main.is_file():
            atomic.write_json(self.path / "fingerprint.resumed.json", fp)
            if self.change is not None:  # the run's recipe hash and its change log, where diff and compare look
                # the changed recipe is written only now, once the checkpoint has loaded under it
                atomic.write_text(self.path / rundir.RECIPE, recipe_yaml(self.recipe))
                doc = json.loads(main.read_text())
                inputs = doc.setdefault("run_inputs", {})
                inputs["recipe_sha256"] = self.change["recipe_sha256_after"]
                inputs.setdefault("changes", []).append(self.change)
                atomic.write_json(main, doc)
                self.changes = inputs["changes"]
            else:
                self.changes = json.loads(main.read_text()).get("run_inputs", {}).get("changes", [])
        else:
            if self.change is not None:
                fp.setdefault("run_inputs", {})["changes"] = [self.change]
                self.changes = [self.change]
            atomic.write_json(main, fp)

    # -- the loop -------------------------------------------------------------------------
    def train(self) -> None:
        assert self.engine is not None and self.steps is not None and self.checkpoints is not None
        engine, steps, world = self.engine, self.steps, self.env.world_size
        self._check_stop()  # a signal during setup: stop before the first step
        for step in range(self.step + 1, self.total + 1):
            t0 = time.perf_counter()
            stats = steps.step(step)
            # a collection due after this step is part of its time (as an automatic one inside it would be)
            gc_s = self._gc_collect(step) if self.gc.due(step) else 0.0
            dt = time.perf_counter() - t0
            if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
                self.diverged_at = step
                self.error = (f"non-finite {'loss' if not math.isfinite(stats.loss) else 'gradient norm'} at step "
                              f"{step} (loss {stats.loss}, grad_norm {stats.grad_norm}); the latest checkpoint "
                              f"is {'step ' + str(self.checkpoints.last_step) if self.checkpoints.last_step else 'none'}"
                              f", from which --resume --allow-change continues with a changed recipe")
                log.error(self.error)
                break
            row = {"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": steps.lr,
                   "step_time_s": dt, "tokens": stats.tokens, "supervised_tokens": stats.supervised_tokens,
                   "tokens_per_s": stats.tokens / dt, "tokens_per_s_per_gpu": stats.tokens / dt / world,
                   "peak_memory_gib": engine.peak_memory_gib(), "gc_s": gc_s}
            if self._validation_due(step):  # after the step's timing: its own seconds are val_s
                row.update(self._validate(step))
            self.metrics.append(row)
            self.loggers.log(row)
            self.step = step
            faults.point("after-step", step)
            if self._decide(step):
                break
        self.rank_peaks = dist.gather(engine.peak_memory_gib())
        if self.diverged_at is not None:
            self.status = "diverged"
        elif self.step >= self.total:
            self.status = "completed"
        else:
            self.status = "interrupted"
            if self.step > (self.checkpoints.last_step or 0):
                self._save(self.step)
            log.warning("interrupted (%s) after step %d; checkpoint at step %s", self.stop.signal, self.step,
                        self.checkpoints.last_step)
        self.checkpoints.wait()

    # -- validation -----------------------------------------------------------------------
    def _validation_due(self, step: int) -> bool:
        """Every ``validation.eval_interval`` steps and at the last step of the run (once there)."""
        held = self.held_out
        return held is not None and (step % held.eval_interval == 0 or step == self.total)

    def _validate(self, step: int) -> dict[str, Any]:
        """The held-out loss after ``step``, on every rank; with manual garbage collection and
        ``training.gc.eval`` a full collection before it and a young-generation one after it (as
        Megatron-Bridge's ``manual_gc_eval``), outside every step's time."""
        import gc

        assert self.steps is not None
        collect = self.gc.manual and self.gc.eval
        if collect:
            self._gc_collect(step)
        t0 = time.perf_counter()
        loss, supervised = self.steps.evaluate(self.held_out)
        seconds = time.perf_counter() - t0
        if collect:
            gc.collect(generation=0)
        log.info("validation at step %d: val_loss %.6f over %d supervised tokens (%.3fs)", step, loss, supervised,
                 seconds)
        return {"val_loss": loss, "val_supervised_tokens": supervised, "val_s": seconds}

    def _decide(self, step: int) -> bool:
        """After a step: save when due, complete a background save, and say whether to stop."""
        assert self.checkpoints is not None
        if self.stop_after is not None and step >= self.stop_after:
            self.stop.request("stop_after")
        if self.checkpoints.due(step, self.total):
            self._save(step)
            if self.gc.manual and self.gc.eval and not self.gc.due(step):
                self._gc_collect(step)  # what the save left, outside any step's time
        else:
            self.checkpoints.poll()
        return dist.any_flag(self.stop.requested)

    def _save(self, step: int) -> None:
        assert self.checkpoints is not None
        self.checkpoints.save(step, {
            "recipe.yaml": recipe_yaml(self.recipe),
            "metrics.jsonl": "".join(json.dumps(r) + "\n" for r in self.metrics[:step]),
        })

    # -- finish ---------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Results, plots and the loggers' end; the loggers are closed whatever happens."""
        try:
            if getattr(self, "steps", None) is not None:
                self.steps.data.close()  # no more batches made ahead
            return self._finish()
        finally:
            self.loggers.close()

    def _finish(self) -> dict[str, Any]:
        from muse_stack.machine.peak import peak_for
        from muse_stack.results.plots import loss_plot, throughput_plot
        from muse_stack.results.summary import summarise

        if not self.rank0:
            return {}
        if self.resuming and not self.setup_done:
            # a resume refused or stopped before it trained (a checkpoint that does not load, no
            # room for the next one, a signal): the run directory keeps what the last attempt
            # wrote, so the same command resumes it once the cause is fixed (the error is in
            # run.log and on stderr)
            log.error("resume %s before its first step%s; the run directory is unchanged", self.status,
                      f": {self.error}" if self.error else "")
            return {}
        recipe, engine, metrics = self.recipe, self.engine, self.metrics
        warm = warmup_steps(recipe, recipe.training.steps or len(metrics) or 1)
        if self.peak_tflops is None and self.status != "failed":
            self.peak_tflops, self.peak_source = peak_for(recipe.hardware.gpu)
        results = summarise(metrics, model=self.model_cfg, world_size=self.env.world_size,
                            seq_lens=engine.seq_lens() if engine is not None else [recipe.batch.seq_length or 1],
                            warmup=warm, peak_tflops=self.peak_tflops, peak_source=self.peak_source,
                            price_per_gpu_hour=recipe.hardware.price_per_gpu_hour,
                            wall_seconds=self.prior_wall + time.time() - self.started, status=self.status,
                            device=engine.device if engine is not None else "unknown",
                            engine=engine.name if engine is not None else recipe.engine,
                            peft=getattr(engine, "peft", None),
                            towers=getattr(engine, "tower_flops_per_token", lambda: None)())
        results["recipe"] = recipe.name
        if self.rank_peaks is not None and self.env.world_size > 1:
            results["peak_memory_gib_by_rank"] = self.rank_peaks
        if engine is not None:
            results["engine_info"] = self._engine_info()
            from muse_stack.machine.devmem import cuda_memory

            memory = cuda_memory(engine.device)
            if memory is not None:
                results["device_memory"] = memory
        last = self.checkpoints.last_step if self.checkpoints is not None else None
        results["checkpoint"] = ({"step": last, "path": f"checkpoints/step-{last:08d}"} if last is not None
                                 else None)
        if self.checkpoints is not None and self.checkpoints.saves:
            results["checkpoint_saves"] = self.checkpoints.saves
        results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if self.diverged_at is not None:
            results["diverged_at_step"] = self.diverged_at
        if self.error:
            results["error"] = self.error
            log.error("%s: %s", self.status, self.error)
        if self.resuming:
            results["resumed_at_step"] = self.resumed_step
        if self.changes:
            results["changes"] = self.changes
        results["gc"] = {"manual": self.gc.manual, "interval": self.gc.interval, "eval": self.gc.eval,
                         "collections_by_hand": len(self.gc_collections)}
        if self.held_out is not None:
            evaluated = [r for r in metrics if r.get("val_loss") is not None]
            results["validation"] = {**self.held_out.describe(), "evaluations": len(evaluated),
                                     "last_step": evaluated[-1]["step"] if evaluated else None,
                                     "val_loss": evaluated[-1]["val_loss"] if evaluated else None}
        atomic.write_json(self.path / rundir.RESULTS, results)
        self.loggers.end(results)
        self.loggers.close()
        if metrics:
            loss_plot(metrics, self.path / "loss.png", f"{recipe.name}: loss")
            throughput_plot(metrics, self.path / "throughput.png", f"{recipe.name}: tokens/s per GPU",
                            results.get("window"))
        log.info("status %s; results in %s", self.status, self.path / rundir.RESULTS)
        return results

    def _setup_logging(self) -> logging.Handler | None:
        if not self.rank0:
            return None
        handler = logging.FileHandler(self.path / rundir.LOG)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        root = logging.getLogger("muse_stack")
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        return handler
