"""Command: show (one resolved recipe). The catalogue, with what each engine runs, is `list`
(:mod:`muse_stack.cli.engines`)."""

from __future__ import annotations

import json
import textwrap
from typing import Optional

import typer
from rich.console import Console

from muse_stack.cli.complete import recipe_names
from muse_stack.recipes.catalogue import load_recipe, recipe_yaml

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


def _fill_interval(recipe) -> None:
    """The periodic interval the run fills on several nodes (muse_stack/plan/save.py), where the recipe plans;
    one that does not is printed as it is (`plan` and `run` name what is wrong)."""
    from muse_stack.plan.planner import make_plan
    from muse_stack.plan.save import fill_interval
    from muse_stack.util.errors import MuseStackError

    try:
        plan, _ = make_plan(recipe, strict=False)
    except MuseStackError:
        return
    fill_interval(recipe, plan)


def show_cmd(name: str = typer.Argument(..., help="recipe name, alias or YAML file", autocompletion=recipe_names),
             overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
             bridge: bool = typer.Option(False, "--bridge", help="print the Megatron-Bridge key of each field "
                                         "that has one, with the recipe's value"),
             json_out: bool = typer.Option(False, "--json", help="print the resolved recipe as JSON "
                                           "(filled values under \"filled\")"),
             engine_options: bool = typer.Option(False, "--options", help="print each engine option as its "
                                                 "engine resolves it, and where its value came from")) -> None:
    """The resolved recipe as YAML; each value its fill policy filled is under filled, with its source
    (--json: JSON for scripts; --bridge: the Bridge ConfigContainer keys it answers to; --options: the
    engine options as the engine resolves them)."""
    recipe = load_recipe(name, overrides or [])
    _fill_interval(recipe)
    if json_out:
        typer.echo(json.dumps(recipe.model_dump(mode="json"), indent=2))
        return
    if engine_options:
        print_options(recipe)
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


def print_options(recipe) -> None:
    """Each engine option of the recipe's engine, its value and where it came from (stated, or the option's
    default and why it does not apply here): muse_stack/recipes/options.py."""
    from muse_stack.recipes.options import SECTION, resolve

    resolved = resolve(recipe)
    if not resolved:
        typer.echo(f"{recipe.name}: the {recipe.engine} engine reads no engine option")
        return
    typer.echo(f"{recipe.name}: {SECTION} as the {recipe.engine} engine resolves them")
    width = max(console.width, 40)
    rows = [(f"{SECTION}.{key} = {json.dumps(r.value)}", r.source) for key, r in resolved.items()]
    key_w = max(len(k) for k, _ in rows)
    for key, source in rows:
        line = f"{key:<{key_w}}  {source}"
        if len(line) > width:  # the source on its own indented lines, never cut
            line = key + "\n" + textwrap.fill(source, width, initial_indent="    ", subsequent_indent="    ")
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("show")(show_cmd)
