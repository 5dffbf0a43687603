"""CLI: diff (why two runs' numbers differ), audit (a run against its recipe's stack), compare
(whether two runs converge alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from muse_stack.cli.complete import lock_names, recipe_names
from muse_stack.util.errors import InputError, MuseStackError, UsageError


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str, allow_nan=True)


def _stack_from_recipe_obj(recipe: Any) -> Any:
    stack = getattr(recipe, "stack", None) if not isinstance(recipe, dict) else recipe.get("stack")
    if stack is not None and hasattr(stack, "model_dump"):
        stack = stack.model_dump()
    return stack


def _stack_of_lock(name: str) -> tuple[dict, str]:
    from muse_stack.stack.lock import load
    from muse_stack.stack.record import stack_of_lock

    loaded = load(name)
    return stack_of_lock(loaded.lock), f"lock {loaded.name} ({loaded.path})"


def _machine_lock(recipe: Any) -> str | None:
    """The lock that builds the image of the machine ``recipe`` runs on (its ``hardware.gpu``)."""
    hardware = recipe.get("hardware") if isinstance(recipe, dict) else getattr(recipe, "hardware", None)
    gpu = hardware.get("gpu") if isinstance(hardware, dict) else getattr(hardware, "gpu", None)
    if not isinstance(gpu, str):
        return None
    from muse_stack.machine.table import table

    machines = table().machines
    return machines[gpu].lock if gpu in machines else None


def diff_cmd(
    a: str = typer.Argument(..., help="Fingerprint file or run directory (reference)."),
    b: str = typer.Argument(..., help="Fingerprint file or run directory (candidate)."),
    as_json: bool = typer.Option(False, "--json", help="Print the differences as JSON."),
) -> None:
    """Classified differences between two stack fingerprints (and, between two run
    directories, between their resolved recipes).

    Exit 0 identical (capture time and pid ignored), 1 only performance or informational
    differences, 2 numerics differ, 3 unreadable input.
    """
    from muse_stack.compare.diff import diff_inputs

    report = diff_inputs(a, b)
    if as_json:
        typer.echo(_dump(report.as_dict()))
    else:
        from muse_stack.compare.report import render_diff

        render_diff(report, Console())
    raise typer.Exit(report.exit_code)


def audit_cmd(
    run: str = typer.Argument(..., help="Run directory (fingerprint.json, recipe.yaml) or a fingerprint file with --recipe."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Audit against this catalogue recipe's recorded stack.",
                                         autocompletion=recipe_names),
    lock: Optional[str] = typer.Option(None, "--lock", help="Audit against this stack lock's pins (cpu, h200, b200, "
                                       "gb200 or a lock file).", autocompletion=lock_names),
    as_json: bool = typer.Option(False, "--json", help="Print the audit as JSON."),
) -> None:
    """Check a run's fingerprint against the stack its recipe recorded; a recipe that records none
    (e.g. tiny-cpu) is audited against the lock of its machine's image (--lock names another).

    Exit 0 all components match, 1 some cannot be verified, 2 any mismatch, 3 unreadable input.
    """
    from muse_stack.compare.audit import audit
    from muse_stack.compare.runs import read_recipe
    from muse_stack.fingerprint.document import load_fingerprint

    fingerprint = load_fingerprint(run)
    if recipe and lock:
        raise InputError("--recipe and --lock name two stacks to audit against", field="--lock", value=lock,
                         fix="pass one of them")
    if lock:
        stack, source = _stack_of_lock(lock)
    elif recipe:
        from muse_stack.recipes.catalogue import load_recipe

        stack = _stack_from_recipe_obj(load_recipe(recipe))
        source = f"recipe {recipe}"
    else:
        run_dir = Path(run)
        if not run_dir.is_dir():
            raise InputError(
                f"{run} is a file; the recorded stack comes from a run directory's recipe.yaml",
                field="run", value=run, fix="pass the run directory, or add --recipe NAME",
            )
        run_recipe = read_recipe(run_dir)
        stack = _stack_from_recipe_obj(run_recipe)
        source = str(run_dir / "recipe.yaml")
        if not stack:  # the image's lock of the machine the recipe runs on
            image_lock = _machine_lock(run_recipe)
            if image_lock is not None:
                stack, source = _stack_of_lock(image_lock)
    if not stack:
        raise InputError(
            f"{source} records no stack to audit against",
            field="stack", value=None, fix="pass --recipe NAME of a catalogue recipe whose stack is recorded, or "
                                            "--lock NAME (a stack lock: cpu, h200, b200, gb200)",
        )
    if not isinstance(stack, dict):
        raise InputError(f"{source}: stack must be a mapping", field="stack", value=stack,
                         fix="record the stack as key: free-text value pairs")
    report = audit(stack, fingerprint, source=source, fingerprint_name=run)
    if as_json:
        typer.echo(_dump(report.as_dict()))
    else:
        from muse_stack.compare.report import render_audit

        render_audit(report, Console())
    raise typer.Exit(report.exit_code)


def compare_cmd(
    run_a: str = typer.Argument(..., help="Golden (reference) run directory."),
    run_b: str = typer.Argument(..., help="Candidate run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Plot file (default RUN_B/compare-<name of RUN_A>.png)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Do not write a plot."),
    preset: str = typer.Option("bridge-function", "--preset",
                               help="Threshold set: bridge-function (Megatron-Bridge's function defaults: final "
                                    "loss 3%, no skip) or bridge-pipeline (its performance pipeline: final 5%, "
                                    "skip the first 20%). Options below override it."),
    skip_first: Optional[str] = typer.Option(None, "--skip-first",
                                             help="Skip the first points: a fraction as in Bridge's "
                                                  "skip_first_percent (0.2) or a percent with its sign (20%); "
                                                  "a bare 1 or more is refused."),
    skip_first_percent: Optional[str] = typer.Option(None, "--skip-first-percent", hidden=True,
                                                     help="Bridge's name for --skip-first (a fraction)."),
    min_correlation: float = typer.Option(0.95, "--min-correlation", help="Minimum Pearson correlation."),
    high_loss_tolerance: float = typer.Option(0.10, "--high-loss-tolerance", help="Relative tolerance where golden loss > --high-loss-above."),
    medium_loss_tolerance: float = typer.Option(0.05, "--medium-loss-tolerance", help="Relative tolerance where golden loss > --medium-loss-above."),
    low_loss_tolerance: float = typer.Option(0.02, "--low-loss-tolerance", help="Relative tolerance for smaller golden loss."),
    high_loss_above: float = typer.Option(2.0, "--high-loss-above"),
    medium_loss_above: float = typer.Option(0.5, "--medium-loss-above"),
    max_pointwise_failures: float = typer.Option(0.10, "--max-pointwise-failures", help="Largest allowed fraction of points outside tolerance."),
    final_loss_tolerance: Optional[float] = typer.Option(None, "--final-loss-tolerance", help="Largest relative final-loss difference (default from --preset)."),
    outlier_sigma: float = typer.Option(3.0, "--outlier-sigma"),
    max_outlier_ratio: float = typer.Option(0.10, "--max-outlier-ratio"),
    max_throughput_drop: Optional[float] = typer.Option(None, "--max-throughput-drop", help="Fail if tokens/s per GPU drops more than this percent."),
    max_memory_increase: Optional[float] = typer.Option(None, "--max-memory-increase", help="Fail if peak memory rises more than this percent."),
    validation: bool = typer.Option(False, "--validation",
                                    help="Also judge the validation curves (val_loss, recipe validation) with "
                                         "the same checks; both runs must have validated at the same steps."),
) -> None:
    """Convergence (loss curves), throughput, memory and stack of a candidate run against a golden run.

    Exit 0 pass, 1 fail, 3 unreadable input.
    """
    from muse_stack.compare.convergence import PRESETS, Thresholds, parse_skip
    from muse_stack.compare.runcompare import Gates, compare_runs

    if preset not in PRESETS:
        raise UsageError(f"no threshold preset {preset!r}", field="--preset", value=preset,
                         fix=f"use one of {', '.join(PRESETS)}")
    chosen = dict(PRESETS[preset])
    if skip_first is not None and skip_first_percent is not None:
        raise UsageError("the skip is given twice", field="--skip-first", value=[skip_first, skip_first_percent],
                         fix="give --skip-first (or Bridge's spelling --skip-first-percent) once")
    skip_first = skip_first if skip_first is not None else skip_first_percent
    if skip_first is not None:
        try:
            chosen["skip_first"] = parse_skip(skip_first)
        except ValueError as exc:
            raise UsageError(str(exc), field="--skip-first", value=skip_first,
                             fix="write a fraction in [0, 1) as Megatron-Bridge does (0.2), or a percent (20%)") from None
    if final_loss_tolerance is not None:
        chosen["final_loss_tolerance"] = final_loss_tolerance
    thresholds = Thresholds(
        correlation_min=min_correlation,
        high_loss_above=high_loss_above,
        medium_loss_above=medium_loss_above,
        high_loss_tolerance=high_loss_tolerance,
        medium_loss_tolerance=medium_loss_tolerance,
        low_loss_tolerance=low_loss_tolerance,
        max_pointwise_failure_ratio=max_pointwise_failures,
        final_loss_tolerance=chosen["final_loss_tolerance"],
        outlier_sigma=outlier_sigma,
        max_outlier_ratio=max_outlier_ratio,
        skip_first=chosen["skip_first"],
    )
    report = compare_runs(run_a, run_b, thresholds, Gates(max_throughput_drop, max_memory_increase),
                          plot=plot, make_plot=not no_plot, validation=validation)
    if as_json:
        typer.echo(_dump(report.as_dict()))
    else:
        from muse_stack.compare.report import render_compare

        render_compare(report, Console())
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    app.command("diff")(diff_cmd)
    app.command("audit")(audit_cmd)
    app.command("compare")(compare_cmd)


__all__ = ["register", "MuseStackError"]
