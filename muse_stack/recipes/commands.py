"""Commands: list, show, plan, record import/export."""

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
from muse_stack.plan.planner import Plan, make_plan
from muse_stack.recipes.catalogue import load_recipe, recipe_names, recipe_yaml

console = Console()


def _layout_label(recipe) -> str:
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


def print_plan(plan: Plan) -> None:
    t = Table(title=f"plan: {plan.recipe}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("GPUs", f"{plan.world_size} x {plan.gpu} ({plan.nodes} nodes)")
    t.add_row("layout", f"TP {plan.tp}  PP {plan.pp}  CP {plan.cp}  EP {plan.ep}  ETP {plan.etp}  "
                        f"SP {plan.sequence_parallel}")
    t.add_row("data parallel", f"DP {plan.dp}   expert DP {plan.expert_dp} (world / (EP x ETP x PP))")
    if plan.stages:
        text = "/".join(str(n) for n in plan.stages)
        holds = "; ".join(f"stage {s}: {', '.join(h)}" for s, h in plan.stage_holds.items())
        t.add_row("stages", f"{text}  ({holds})" if holds else text)
    t.add_row("microbatches", f"{plan.microbatches_per_replica} per replica per step")
    t.add_row("tokens per step", f"{plan.tokens_per_step:,}" if plan.tokens_per_step else "unknown")
    if plan.steps_per_epoch is not None:
        t.add_row("steps per epoch", str(plan.steps_per_epoch))
    t.add_row("steps", str(plan.steps))
    t.add_row("experts per EP rank", f"{plan.experts_per_ep_rank:g}" if plan.experts_per_ep_rank else "unknown")
    t.add_row("pack alignment", str(plan.pack_alignment))
    t.add_row("parameters", f"{plan.total_params:,} total, {plan.active_params:,} active per token")
    if plan.peft is not None:
        p = plan.peft
        experts = [t for t in p["targets"] if t.startswith("mlp.experts.")]
        t.add_row("adapters", f"{p['scheme'].upper()} rank {p['rank']} alpha {p['alpha']:g} dropout {p['dropout']:g} "
                              f"on {', '.join(p['targets'])}"
                              + (f" ({'one per expert' if p['per_expert'] else 'one shared by all experts'})"
                                 if experts else "")
                              + f"; {plan.adapter_params:,} adapter parameters, base frozen")
    console.print(t)
    if plan.memory:
        m = Table(title="memory per GPU (GiB), by pipeline stage", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
        for col in ("stage", "layers", "params", "weights", "grads", "optim", "activ", "logits", "buf", "total"):
            m.add_column(col, justify="right", min_width=len(col), no_wrap=True)
        for s in plan.memory:
            def f(x):
                return "?" if x is None else f"{x:.1f}"
            activ = None if s.activations_gib is None else s.activations_gib * s.activation_factor
            m.add_row(str(s.stage), str(s.layers), f"{s.params / 1e9:.2f}B", f(s.weights_gib), f(s.grads_gib),
                      f(s.optimizer_gib), "-" if activ is None else f(activ),
                      "-" if s.logits_gib is None else f(s.logits_gib), f(s.buffers_gib), f(s.total_gib))
        console.print(m)
        if plan.peak_memory_gib is not None and plan.gpu_memory_gib is None:
            console.print(f"peak {plan.peak_memory_gib:.1f} GiB estimated per process (no GPU memory to check against)")
        elif plan.peak_memory_gib is not None:
            verdict = "[green]fits[/]" if plan.fits else "[red]does not fit[/]"
            console.print(f"peak {plan.peak_memory_gib:.1f} GiB (stage {plan.peak_stage}) of "
                          f"{plan.gpu_memory_gib:.2f} GiB per {plan.gpu}: {verdict} "
                          f"(needs {plan.calibration.headroom_fraction:.0%} headroom; "
                          f"activ: modelled x {plan.memory[plan.peak_stage].activation_factor:.2f}, "
                          f"runtime buffers {plan.calibration.runtime_overhead_gib} GiB)")
    for a in plan.assumptions:
        console.print(f"[yellow]assumed:[/] {a}")
    if plan.peft is not None and plan.peft["filled"]:
        from muse_stack.recipes.peft import DEFAULTS_SOURCE, INIT

        console.print(f"[yellow]filled:[/] {', '.join(plan.peft['filled'])} (not stated by the recipe; "
                      f"{DEFAULTS_SOURCE})")
    if plan.peft is not None:
        from muse_stack.recipes.peft import INIT

        console.print(f"adapter init: {INIT}")
    for u in plan.unchecked:
        console.print(f"[yellow]not checked:[/] {u}")
    if plan.unstated_training:
        console.print(f"[yellow]not stated:[/] {', '.join(plan.unstated_training)}: `run` and `launch` refuse the "
                      "recipe until it states them (neither engine fills in a value that changes training)")


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_cmd(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
        """The recipe catalogue: alias, task, GPUs, hardware, layout."""
        rows = []
        for name in recipe_names():
            r = load_recipe(name)
            rows.append({"name": r.name, "task": r.task, "gpus": r.hardware.count, "hardware": r.hardware.gpu,
                         "layout": _layout_label(r), "engine": r.engine,
                         "source": r.aliases[0] if r.aliases else r.provenance.source})
        if json_out:
            typer.echo(json.dumps(rows, indent=2))
            return
        t = Table(title="muse-stack recipes")
        cols = ("name", "task", "gpus", "hardware", "layout", "engine")
        for col in cols:
            t.add_column(col, no_wrap=True)
        for row in rows:
            t.add_row(*(str(row[c]) for c in cols))
        console.print(t)

    @app.command("show")
    def show_cmd(name: str = typer.Argument(..., help="recipe name, alias or YAML file"),
                 overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides")) -> None:
        """The resolved recipe as YAML."""
        typer.echo(recipe_yaml(load_recipe(name, overrides or [])), nl=False)

    @app.command("plan")
    def plan_cmd(name: str = typer.Argument(..., help="recipe name, alias or YAML file"),
                 overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
                 gpus: Optional[int] = typer.Option(None, "--gpus", help="plan for this many GPUs"),
                 json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
        """Validate the layout and estimate memory per GPU, before it costs a GPU-hour."""
        recipe = load_recipe(name, overrides or [])
        plan, _ = make_plan(recipe, gpus=gpus)
        if json_out:
            typer.echo(json.dumps(plan.summary(), indent=2))
        else:
            print_plan(plan)
        if plan.fits is False:
            raise typer.Exit(1)

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
