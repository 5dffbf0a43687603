"""`muse-stack export` and `muse-stack record import|export`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from muse_stack.util import atomic
from muse_stack.util.errors import InputError
from muse_stack.recipes.catalogue import recipe_yaml

console = Console()

record_app = typer.Typer(help="OpenRecipes records: import a published record, export a run as one.",
                         no_args_is_help=True)


def export_cmd(
    run_dir: Path = typer.Argument(..., help="a run directory with a checkpoint"),
    hf: Path = typer.Option(..., "--hf", help="new directory for the Hugging Face checkpoint"),
    max_shard_mb: float = typer.Option(5000.0, "--max-shard-mb", min=0.01,
                                       help="largest safetensors shard in MB (Hugging Face's default, 5 GB)"),
    merge: bool = typer.Option(False, "--merge", help="adapter runs: the base with the adapters folded in"),
    adapters_only: bool = typer.Option(False, "--adapters-only",
                                       help="adapter runs: the adapters in the Hugging Face peft layout"),
) -> None:
    """Write the run's latest checkpoint in transformers' muse_spark layout (MuseSparkForConditionalGeneration loads it)."""
    from muse_stack.util.errors import MuseStackError, UsageError
    from muse_stack.publish.hf import export_run
    from muse_stack.run import checkpoints
    from muse_stack.util.safeio import refuse_secrets

    refuse_secrets(str(hf), field="--hf", error=UsageError, what="the path")
    under = next((p for p in hf.absolute().parents if p.exists() and not p.is_dir()), None)
    if under is not None:
        raise InputError(f"the export directory would be under {under}, which is a file", field="--hf",
                         value=str(hf), fix="choose a path under a directory (or a new one)")

    def latest_step() -> int | None:
        try:
            current = checkpoints.latest(run_dir)
        except MuseStackError:
            return None
        return current.step if current is not None else None

    for attempt in range(3):
        before = latest_step()
        try:
            out, step, count = export_run(run_dir, hf, max_shard_bytes=int(max_shard_mb * 10**6), progress=True,
                                          merge=merge, adapters_only=adapters_only)
            break
        except (FileNotFoundError, MuseStackError) as exc:  # e.g. a step folder removed while it was read
            after = latest_step()
            moved = before is not None and after is not None and after != before
            if moved and attempt < 2 and not hf.exists():
                continue  # the running job saved a newer checkpoint and pruned this one: export that one
            if isinstance(exc, MuseStackError) and not moved:
                raise
            what = exc.filename if isinstance(exc, FileNotFoundError) else type(exc).__name__
            raise InputError(
                f"the checkpoint{f' at step {before}' if before else ''} lost a file while it was read "
                f"({what}): " + ("the run is still saving checkpoints and pruned it" if moved
                                 else "it is incomplete"),
                field="RUN_DIR", value=str(run_dir),
                fix="export again once the run has stopped (or saved its next checkpoint)" if moved else
                    "restore the step folder, or point checkpoints/latest at a complete one") from exc
    console.print(f"exported step {step}: {count} tensors to {out}")


@record_app.command("import")
def record_import(path: Path = typer.Argument(..., help="OpenRecipes record (YAML, or a document holding one)"),
                  name: str = typer.Option(..., "--name", help="recipe name to give it"),
                  out: Optional[Path] = typer.Option(None, "-o", "--out", help="write the recipe here")) -> None:
    """Read an OpenRecipes record into a muse-stack recipe."""
    from muse_stack.recipes.openrecipes import import_record

    recipe = import_record(path, name)
    text = recipe_yaml(recipe)
    if out is None:
        typer.echo(text, nl=False)
        return
    if out.exists():
        raise InputError("the output file exists", field="--out", value=str(out),
                         fix="choose a new path or remove the file first")
    header = (f"# Generated from the OpenRecipes record with:\n#   muse-stack record import {path} "
              f"--name {name} -o {out}\n")
    atomic.write_text(out, header + text, field="--out")
    console.print(f"wrote {out}")


@record_app.command("export")
def record_export(run_dir: Path = typer.Argument(..., help="a run directory"),
                  out: Optional[Path] = typer.Option(None, "-o", "--out", help="write the record here")) -> None:
    """An OpenRecipes record of a finished run: its recipe, measured results and stack."""
    from muse_stack.util.errors import MuseStackError
    from muse_stack.recipes.openrecipes import record_yaml, recipe_to_record
    from muse_stack.run.rundir import read_run

    run = read_run(run_dir)
    status = (run.results or {}).get("status")
    if status != "completed":
        raise MuseStackError(f"only a finished run can be exported (this one is {status or 'without results'})",
                             field="run_dir", value=str(run_dir),
                             rule="a record states what a run measured; an unfinished run measured nothing whole",
                             fix="finish it first (`muse-stack run --resume DIR` for an interrupted run)")
    stack = run.stack_summary()
    rows = (run.fingerprint or {}).get("run_inputs", {}).get("rows_sha256")
    text = record_yaml(recipe_to_record(run.recipe, results=run.results, stack=stack,
                                        rows_sha256=rows if isinstance(rows, str) else None))
    if out is None:
        typer.echo(text, nl=False)
    else:
        if out.exists():
            raise InputError("the output file exists", field="--out", value=str(out),
                             fix="choose a new path or remove the file first")
        atomic.write_text(out, text, field="--out")
        console.print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
    app.add_typer(record_app, name="record")
