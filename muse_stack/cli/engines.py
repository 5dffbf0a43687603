"""Command: list (the recipe catalogue, and whether its engine trains each recipe as written)."""

from __future__ import annotations

import json

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from muse_stack.util.errors import LayoutError, RecipeError
from muse_stack.recipes.catalogue import load_recipe, recipe_names
from muse_stack.resolve.recipe import finalize
from muse_stack.cli.recipes import layout_label

console = Console()


def list_cmd(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """The recipe catalogue: alias, task, GPUs, hardware, layout, engine, and whether its engine
    trains it as written (runs: yes, or the field it refuses and what to pass)."""
    rows = []
    for name in recipe_names():
        r = load_recipe(name)
        try:
            exc = finalize(r).refusal()  # every check `run` and `launch` make before anything starts
        except (RecipeError, LayoutError) as error:  # what cannot even be derived
            exc = error
        runs = "no" if exc is not None else "yes"
        rows.append({"name": r.name, "task": r.task, "gpus": r.hardware.count, "hardware": r.hardware.gpu,
                     "layout": layout_label(r), "engine": r.engine, "runs": runs,
                     "refused": f"{exc.field}: {exc.message}" if exc is not None else None,
                     "fix": exc.fix if exc is not None else None,
                     "source": r.aliases[0] if r.aliases else r.provenance.source})
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    # fits 80 columns: no borders, short headers; a long layout wraps rather than being cut
    t = Table(title="muse-stack recipes", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              show_edge=False, collapse_padding=True)
    cols = (("name", "name"), ("task", "task"), ("gpus", "GPUs"), ("hardware", "type"), ("layout", "layout"),
            ("engine", "engine"), ("runs", "runs"))
    for key, header in cols:
        t.add_column(header, no_wrap=key != "layout", overflow="fold", justify="right" if key == "gpus" else "left")
    for row in rows:
        t.add_row(*(str(row[c]) for c, _ in cols))
    console.print(t)
    for row in rows:
        if row["refused"]:
            fix = f"; fix: {row['fix']}" if row["fix"] else ""
            console.print(f"{row['name']} does not run as written: {row['refused']}{fix}", markup=False,
                          highlight=False)



def register(app: typer.Typer) -> None:
    app.command("list")(list_cmd)
