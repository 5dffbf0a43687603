"""`muse-stack data build` and `muse-stack data show`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from muse_stack.cli.complete import recipe_names
from muse_stack.util.atomic import write_bytes

data_app = typer.Typer(help="Build and inspect the training rows of a recipe.", no_args_is_help=True)
console = Console()


def _stats_table(title: str, stats: dict) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # hashes and paths wrap, never cut
    for key, value in stats.items():
        if value is not None:
            table.add_row(key, str(value))
    return table


@data_app.command("build")
def build_cmd(
    name: str = typer.Argument(..., help="recipe name, alias or YAML file", autocompletion=recipe_names),
    overrides: list[str] = typer.Argument(None, help="dotted key=value overrides, e.g. data.seed=7"),
    out: Path | None = typer.Option(None, "--out", help="also copy rows.parquet and build.json here"),
    cache: Path | None = typer.Option(None, "--cache", help="cache directory (default $MUSE_STACK_CACHE/data "
                                      "or ~/.cache/muse-stack/data)"),
    force: bool = typer.Option(False, "--force", help="rebuild even when the cache has the rows, and replace "
                               "the files --out already holds"),
    as_json: bool = typer.Option(False, "--json", help="print the build summary as JSON"),
) -> None:
    """Build (or find in the cache) the rows of a recipe and print their sha256 and statistics."""
    from muse_stack.data.build import build_for_recipe
    from muse_stack.util.errors import InputError
    from muse_stack.recipes.catalogue import load_recipe

    if out is not None and not force:  # before anything is built: the refusal leaves nothing behind
        there = [f for f in ("rows.parquet", "build.json") if (out / f).exists()]
        if there:
            raise InputError(f"--out already holds {' and '.join(there)}; a build never overwrites them unasked",
                             field="--out", value=str(out),
                             fix="give another --out path, or pass --force to rebuild and replace them")
    recipe = load_recipe(name, overrides or [])
    built = build_for_recipe(recipe, cache_dir=cache, progress=not as_json, force=force)
    if out is not None:
        for fname in ("rows.parquet", "build.json"):
            write_bytes(out / fname, (built.path / fname).read_bytes(), field="--out")
    summary = {"recipe": recipe.name, "path": str(built.path), "rows_sha256": built.rows_sha256,
               "rows": built.num_rows, "stats": built.stats}
    if out is not None:
        summary["out"] = str(out)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    console.print(_stats_table(f"{recipe.name}: {built.num_rows} rows", built.stats))
    console.print(f"rows_sha256 {built.rows_sha256}")
    console.print(f"cached at   {built.path}")
    recorded = recipe.data.rows_sha256
    if recorded:
        same = recorded == built.rows_sha256
        console.print(f"recorded    {recorded} ({'[green]same[/]' if same else '[red]differs[/]'})")


@data_app.command("show")
def show_cmd(
    name: str = typer.Argument(..., help="recipe name, alias or YAML file", autocompletion=recipe_names),
    overrides: list[str] = typer.Argument(None, help="dotted key=value overrides"),
    cache: Path | None = typer.Option(None, "--cache", help="cache directory to look for a finished build"),
) -> None:
    """Show what the recipe's data section resolves to, and its cached build if there is one."""
    from muse_stack.data.build import BuiltData, cache_key, default_cache_dir, plan_for_recipe
    from muse_stack.data.chat import ChatTokenizer
    from muse_stack.util.errors import MuseStackError
    from muse_stack.recipes.catalogue import load_recipe

    recipe = load_recipe(name, overrides or [])
    plan = plan_for_recipe(recipe, require_tokenizer=False)
    d = recipe.data
    unknown = "unknown (no tokenizer)"
    info = {"kind": d.kind, "source": ", ".join(d.files) if d.files else (f"{d.dataset}@{d.revision} "
            f"[{d.split or 'train'}]" if d.dataset else None), **plan.params(),
            "alignment": plan.alignment, "gbs": plan.gbs,
            "tokenizer": unknown if plan.tokenizer_missing else str(plan.tokenizer_dir or ""),
            "template_kwargs": d.template_kwargs or None, "recorded rows_sha256": d.rows_sha256,
            "recorded build": d.build_name}
    tokenizer = None
    if plan.tokenizer_dir is not None:
        tokenizer = ChatTokenizer(plan.tokenizer_dir, d.template_kwargs)
        info.update(vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                    pad_id=tokenizer.pad_id)
    elif plan.tokenizer_missing:
        # token ids and the cache key depend on the tokenizer: marked unknown, not guessed
        info.update(vocab_size=unknown, bos_id=unknown, eos_id=unknown, pad_id=unknown, cache_key=unknown)
    console.print(_stats_table(f"{recipe.name}: data", info))
    if plan.tokenizer_missing:
        console.print(f"[yellow]tokenizer not found:[/] {escape(plan.tokenizer_missing)}; the token-dependent "
                      "fields are unknown. `data build` needs it: set data.tokenizer to a directory with "
                      "tokenizer.json and chat_template.jinja, or download the model's tokenizer into the Hugging "
                      "Face cache", soft_wrap=False)
        return
    try:
        key, _ = cache_key(recipe, plan, tokenizer)
    except MuseStackError as exc:
        console.print(f"[yellow]source not available:[/] {escape(exc.message)}")
        return
    path = (Path(cache) if cache else default_cache_dir()) / f"{plan.label}-{key[:16]}"
    if path.is_dir():
        built = BuiltData.open(path)
        console.print(_stats_table(f"cached build {path}", {"rows_sha256": built.rows_sha256, **built.stats}))
    else:
        console.print(f"not built yet (would be cached at {escape(str(path))}); run `muse-stack data build {name}`")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")

