"""Commands: list, show, record import/export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from muse_stack import atomic
from muse_stack.errors import InputError
from muse_stack.recipes.catalogue import load_recipe, recipe_names, recipe_yaml

console = Console()


def layout_label(recipe) -> str:
    lay = recipe.layout
    parts = [f"TP{lay.tp}", f"PP{lay.pp}"]
    if lay.cp is None or lay.cp > 1:
        parts.append(f"CP{lay.cp if lay.cp is not None else '?'}")
    parts.append(f"EP{lay.ep if lay.ep is not None else '?'}")
    if lay.etp > 1:
        parts.append(f"ETP{lay.etp}")
    if lay.sequence_parallel:
        parts.append("SP")
    return "/".join(parts)


def print_filled(recipe) -> None:
    """The values the recipe's fill policy filled, grouped by source."""
    by_source: dict[str, list[str]] = {}
    for path, f in recipe.filled.items():
        by_source.setdefault(f.source, []).append(f"{path} = {json.dumps(f.value)}")
    for src, items in by_source.items():
        console.print(f"[yellow]filled:[/] {', '.join(items)} (not stated by the recipe; {src})", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_cmd(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
        """The recipe catalogue: alias, task, GPUs, hardware, layout."""
        rows = []
        for name in recipe_names():
            r = load_recipe(name)
            rows.append({"name": r.name, "task": r.task, "gpus": r.hardware.count, "hardware": r.hardware.gpu,
                         "layout": layout_label(r), "engine": r.engine,
                         "source": r.aliases[0] if r.aliases else r.provenance.source})
        if json_out:
            typer.echo(json.dumps(rows, indent=2))
            return
        # fits 80 columns: no borders, short headers; a long layout wraps rather than being cut
        t = Table(title="muse-stack recipes", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, collapse_padding=True)
        cols = (("name", "name"), ("task", "task"), ("gpus", "GPUs"), ("hardware", "type"), ("layout", "layout"),
                ("engine", "engine"))
        for key, header in cols:
            t.add_column(header, no_wrap=key != "layout", overflow="fold", justify="right" if key == "gpus" else "left")
        for row in rows:
            t.add_row(*(str(row[c]) for c, _ in cols))
        console.print(t)

    @app.command("show")
    def show_cmd(name: str = typer.Argument(..., help="recipe name, alias or YAML file"),
                 overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
                 bridge: bool = typer.Option(False, "--bridge", help="print the Megatron-Bridge key of each field "
                                             "that has one, with the recipe's value"),
                 json_out: bool = typer.Option(False, "--json", help="print the resolved recipe as JSON "
                                               "(filled values under \"filled\")")) -> None:
        """The resolved recipe as YAML; each value its fill policy filled is under filled, with its source
        (--json: JSON for scripts; --bridge: the Bridge ConfigContainer keys it answers to)."""
        recipe = load_recipe(name, overrides or [])
        if json_out:
            typer.echo(json.dumps(recipe.model_dump(mode="json"), indent=2))
            return
        if not bridge:
            typer.echo(recipe_yaml(recipe), nl=False)  # ends with `filled:`, each filled value and its source
            return
        from muse_stack.recipes.bridge import bridge_rows

        # one line per key, "Bridge key  recipe field = value"; where that is wider than the terminal,
        # the field goes on its own indented line, so neither name is ever cut
        rows = [(k, f"{f} = {'null' if v is None else json.dumps(v)}") for k, f, v in bridge_rows(recipe)]
        width = max(console.width, 40)
        key_w = max(len(k) for k, _ in rows)
        typer.echo(f"{recipe.name}: Megatron-Bridge ConfigContainer keys accepted as overrides")
        typer.echo(f"{'Bridge key':<{key_w}}  recipe field = value")
        for key, rest in rows:
            line = f"{key:<{key_w}}  {rest}"
            typer.echo(line if len(line) <= width else f"{key}\n    {rest}")

    record = typer.Typer(help="OpenRecipes records: import a published record, export a run as one.",
                         no_args_is_help=True)

    @record.command("import")
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

    @record.command("export")
    def record_export(run_dir: Path = typer.Argument(..., help="a run directory"),
                      out: Optional[Path] = typer.Option(None, "-o", "--out", help="write the record here")) -> None:
        """An OpenRecipes record of a finished run: its recipe, measured results and stack."""
        from muse_stack.recipes.openrecipes import record_yaml, recipe_to_record
        from muse_stack.run.rundir import read_run

        from muse_stack.errors import MuseStackError

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

    app.add_typer(record, name="record")
