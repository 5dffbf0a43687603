"""`muse-stack run`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from muse_stack.cli.complete import recipe_names

console = Console()


def _dry_run_line(r: dict) -> str:
    where = r.get("run_dir")
    action = r.get("action")
    if action == "resume":
        changes = r.get("changes") or {}
        extra = f", with changes to {', '.join(changes)}" if changes else ""
        return f"dry run: checks passed; would resume {where} from step {r.get('from_step')}{extra}; nothing written"
    if action == "restart":
        return (f"dry run: checks passed; would restart {where} at step 1 (its last attempt left no checkpoint); "
                "nothing written")
    if action == "completed":
        return f"dry run: {where} completed ({r.get('steps_completed')} steps); nothing to do; nothing written"
    return f"dry run: checks passed; would start a new run of {r.get('recipe')} in {where}; nothing written"


def _report(outcome, *, as_json: bool) -> None:
    """The run's end on stdout: its JSON summary, or the dry run's line, or the status, losses, throughput and
    files; a run that did not complete exits 1."""
    r = outcome.results
    if as_json:
        typer.echo(json.dumps({"status": outcome.status, "run_dir": str(outcome.path), **(r or {})},
                              default=str))
        if outcome.status not in ("completed", "dry-run"):
            raise typer.Exit(1)
        return
    if outcome.status == "dry-run":
        console.print(_dry_run_line(r), highlight=False, markup=False, soft_wrap=True)  # one line: its path whole
        return
    if not r:
        if outcome.status != "completed":
            console.print(f"[bold]{outcome.status}[/]: the run directory is unchanged", highlight=False)
            raise typer.Exit(1)
        return
    if r.get("note"):
        console.print(escape(r["note"]), highlight=False)
    if r.get("error"):
        console.print(f"[bold]{outcome.status}[/]: {escape(r['error'])}", highlight=False)
    console.print(f"[bold]{outcome.status}[/]: {r.get('steps_completed')} steps, loss "
                  f"{r.get('first_loss'):.4f} -> {r.get('final_loss'):.4f}" if r.get("first_loss") is not None
                  else f"[bold]{outcome.status}[/]")
    if r.get("tokens_per_s_per_gpu"):
        mfu = f", MFU {r['mfu']:.2%} of {r['peak_tflops']:.3g} TFLOP/s" if r.get("mfu") is not None else ""
        console.print(f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s per {'GPU' if r['device'] != 'cpu' else 'process'}"
                      f" over steps {r['window'][0]}-{r['window'][1]}, step-time CV "
                      f"{r['step_time_cv_percent']:.1f}%{mfu}")
        if r.get("step_time_median_s") is not None:
            worst = (f", slowest step {r['step_time_worst_step']} at {r['step_time_worst_ratio']:.2f}x the "
                     f"median" if r.get("step_time_worst_ratio") is not None else "")
            console.print(f"step time mean {r['step_time_mean_s']:.4g} s, median {r['step_time_median_s']:.4g} s"
                          f"{worst}", highlight=False)
    console.print(f"run directory: {outcome.path}")
    for f in ("recipe.yaml", "fingerprint.json", "metrics.jsonl", "results.json", "loss.png", "throughput.png",
              "run.log", "checkpoints", "tensorboard"):
        if (outcome.path / f).exists():
            console.print(f"  {outcome.path / f}")
    if outcome.status != "completed":
        raise typer.Exit(1)


def run_cmd(
    name: Optional[str] = typer.Argument(None, help="recipe name, alias or YAML file", autocompletion=recipe_names),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (processes) to run on"),
    steps: Optional[int] = typer.Option(None, "--steps", help="optimizer steps (overrides the recipe)"),
    out: Optional[Path] = typer.Option(None, "--out", help="new run directory (default runs/NAME-TIME)"),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="DIR: continue a run directory from its latest checkpoint (after an interrupt, "
                               "a crash or a kill; a RECIPE given too must resolve to the run's recipe); "
                               "auto (with RECIPE and --out): resume --out when it holds a "
                               "checkpoint, else start or restart it there (what a cluster job runs on every "
                               "attempt; a folder named auto is ./auto)"),
    allow_change: bool = typer.Option(
        False, "--allow-change",
        help="with --resume: continue with an edited recipe.yaml, new overrides or --steps, recorded in the run"),
    pretrained_checkpoint: Optional[str] = typer.Option(
        None, "--pretrained-checkpoint", help="HF-style checkpoint directory to start from"),
    stop_after: Optional[int] = typer.Option(
        None, "--stop-after", min=1,
        help="interrupt after this step: the checkpoint is saved and --resume continues the run"),
    no_progress: bool = typer.Option(False, "--no-progress",
                                     help="no progress bar: a step line on stdout every training.log_interval "
                                          "steps"),
    dry_run: bool = typer.Option(False, "--dry-run", help="make every check and say what the run would do; "
                                                          "write nothing"),
    as_json: bool = typer.Option(False, "--json", help="the final summary as one JSON document on stdout "
                                                       "(step lines go to stderr)"),
) -> None:
    """Validate, fingerprint and train a recipe; write results beside the fingerprint."""
    import sys

    from muse_stack.run.pipeline import run
    from muse_stack.run.resume import AUTO

    auto = resume == AUTO
    if resume is None and name is None:
        raise typer.BadParameter("give a recipe name, or --resume DIR")
    from muse_stack.util.errors import UsageError
    from muse_stack.util.safeio import refuse_secrets

    for flag, value in (("--out", out), ("--resume", resume)):  # paths are printed and written
        if value is not None:
            refuse_secrets(str(value), field=flag, error=UsageError, what="the path")
    if resume is not None and not auto and name is not None:
        if name.startswith("-"):
            name = None
        elif "=" in name:  # the first override, not a recipe
            overrides, name = [name, *(overrides or [])], None
        # else RECIPE with --resume DIR: the run continues only if RECIPE resolves to the run's own recipe
        # (or, with --allow-change, with RECIPE, the change recorded)
    if (resume is None or auto) and name is not None:
        # after what the engine refuses in the recipe itself (on any machine), the engine and the
        # device: on a machine without them, that is the error to see, not the process count or
        # the layout that --gpus would lead to
        from muse_stack.run.availability import check_runnable_here
        from muse_stack.recipes.catalogue import load_recipe
        from muse_stack.resolve.recipe import resolve

        resolved = resolve(load_recipe(name, overrides or []), values=False)
        check_runnable_here(resolved.recipe, name)
        resolved.validate()  # then the optimizer values neither the recipe nor its fill policy states
    outcome = run(name, overrides=overrides or [], out=out,
                  steps=steps, gpus=gpus, resume=resume if auto or resume is None else Path(resume),
                  pretrained_checkpoint=pretrained_checkpoint, progress=not no_progress and not as_json,
                  stop_after=stop_after, allow_change=allow_change, dry_run=dry_run,
                  step_stream=sys.stderr if as_json else None)
    _report(outcome, as_json=as_json)


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
