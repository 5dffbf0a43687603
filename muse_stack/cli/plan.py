"""Commands: plan (the layout rules, memory and step time of one recipe) and tune (the layout search)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from muse_stack.cli.complete import recipe_names
from muse_stack.util import atomic
from muse_stack.util.errors import InputError
from muse_stack.machine.hardware import gpus as gpus_of_table
from muse_stack.plan.planner import Plan, make_plan
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.cli.recipes import layout_label, print_filled
from muse_stack.resolve.recipe import finalize

console = Console()


def facts_table(title: str) -> Table:
    """A table of named facts: the name in bold, then its value, the title on the left."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    return t


def print_plan(plan: Plan) -> None:
    t = facts_table(f"plan: {plan.recipe}")
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
    if plan.used is not None:
        u = plan.used
        reserve = (f"allocator reserve {u.allocator_reserve_gib:.1f} "
                   f"({u.calibration.allocator_reserve_fraction:.1%}, measured)")
        console.print(f"expected used (nvidia-smi) {u.used_gib:.1f} GiB = allocated {u.allocated_gib:.1f} + {reserve} "
                      f"+ outside the allocator {u.outside_allocator_gib:.2f} (context, kernels, workspaces; measured) "
                      f"+ NCCL buffers {u.nccl_gib:.2f} ({', '.join(f'{k} {v:.2f}' for k, v in u.nccl_by_group.items())})"
                      + ("" if plan.fits_used is not False else " [red]exceeds the GPU[/]"))
    print_time(plan)
    print_save(plan)
    for a in plan.assumptions:
        console.print(f"[yellow]assumed:[/] {a}")
    if plan.peft is not None and plan.peft["filled"]:
        from muse_stack.models.muse_spark.peft_config import DEFAULTS_SOURCE

        console.print(f"[yellow]filled:[/] {', '.join(plan.peft['filled'])} (not stated by the recipe; "
                      f"{DEFAULTS_SOURCE})")
    if plan.peft is not None:
        from muse_stack.models.muse_spark.peft_config import INIT

        console.print(f"adapter init: {INIT}")
    for u in plan.unchecked:
        console.print(f"[yellow]not checked:[/] {u}")
    if plan.unstated_training:
        console.print(f"[yellow]not stated:[/] {', '.join(plan.unstated_training)}: `run` and `launch` refuse the "
                      "recipe until it states them (neither its fill policy nor either engine fills them in)")


def print_save(plan: Plan) -> None:
    from muse_stack.plan.save import INTERVAL_POLICY, default_interval, signal_seconds

    if plan.save is None:
        return
    step = plan.time.step_s if plan.time is not None else None
    lead = signal_seconds(plan.save.seconds, step)
    text = f"checkpoint save {plan.save.describe()}; the launcher signals {lead} s ahead"
    if step:
        text += (f"; default interval ({INTERVAL_POLICY}) {default_interval(plan.save.seconds, step)} steps where "
                 "training.checkpoint_interval is unset on several nodes")
    console.print(text, highlight=False)


def print_time(plan: Plan) -> None:
    t = plan.time
    if t is None:
        console.print(f"[yellow]step time not estimated:[/] {plan.time_unavailable}")
        return
    price = f"  ${t.usd_per_million_tokens:.2f} per 1M tokens" if t.usd_per_million_tokens is not None else ""
    console.print(f"step time {t.step_s:.3f} s ({t.microbatches} micro-batches)  {t.tokens_per_s_per_gpu:,.1f} tokens/s/GPU  "
                  f"MFU {t.mfu:.1%} (6N: {t.mfu_6n:.1%}){price}  dominant: {t.dominant}")
    m = Table(title="step time by term (per step, on the slowest stage)", title_justify="left", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    m.add_column("term")
    m.add_column("s", justify="right")
    m.add_column("share", justify="right")
    for key, v in t.terms_s.items():
        if v:
            m.add_row(key.replace("_", " "), f"{v:.3f}", f"{v / t.step_s:.0%}")
    console.print(m)
    for c in t.communication:
        console.print(f"communication: {c.term.replace('_', ' ')} {c.seconds:.3f} s: {c.describe()}", highlight=False)
    for a in t.assumptions:
        console.print(f"[yellow]assumed:[/] {a}")


def print_tune(recipe, best: list, planned: int, *, own: bool) -> None:
    """The best layouts that fit, what the search left out, and (``own``: tuning the recipe's own GPUs)
    the best against the recipe's own layout."""
    from muse_stack.plan.tune import bounds

    t = Table(title=f"tune: {recipe.name}, {planned:,} layouts planned, best {len(best)} that fit",
              title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("tokens/s/GPU", "step s", "used GiB", "dominant", "layout"):
        t.add_column(col, justify="right" if col != "layout" else "left")
    for c in best:
        short = c.label
        t.add_row(f"{c.tokens_per_s_per_gpu:,.1f}", f"{c.step_s:.2f}", f"{c.used_gib:.1f}",
                  f"{c.dominant} {c.dominant_s:.2f} s", short)
    console.print(t)
    console.print("not searched: " + "; ".join(bounds(recipe)), highlight=False)
    mine, _ = make_plan(recipe, strict=False)
    if own and mine.time is not None:
        console.print(f"the recipe's own layout: {mine.time.tokens_per_s_per_gpu:,.1f} tokens/s/GPU predicted; "
                      f"best {best[0].tokens_per_s_per_gpu / mine.time.tokens_per_s_per_gpu - 1:+.1%}")


def _gpu_overrides(gpu: str) -> list[str]:
    """The overrides that put a recipe on the GPU type ``gpu`` (--gpu of tune)."""
    from muse_stack.util.errors import LayoutError

    if gpu not in gpus_of_table():
        raise LayoutError("the GPU type is not in the machine table", field="--gpu", value=gpu,
                          fix=f"give one of {', '.join(gpus_of_table())}")
    spec = gpus_of_table()[gpu]
    # the recipe's instance, price and memory are of its own GPU: not carried over
    return [f"hardware.gpu={gpu}", f"hardware.memory_gib={spec.memory_gib}",
            f"hardware.per_node={spec.per_node_default}", "hardware.instance=null",
            "hardware.price_per_gpu_hour=null", "hardware.nominal_memory_gb=null"]


def print_published(step) -> None:
    """A published run's predicted step (muse_stack.plan.scale.ScaleStep)."""
    from muse_stack.plan.published import load

    published = load()
    row, run = published.row(step.row), published.run(step.row)
    t = facts_table(f"plan: {row.id} ({row.label}, {row.system}, {published.source.container})")
    t.add_row("GPUs", f"{row.gpus} x {step.gpu}; {step.links}")
    t.add_row("layout", f"{run.precision}  GBS {run.gbs}  MBS {run.mbs}  seq {run.seq}  TP {run.tp}  PP {run.pp}  "
                        f"VP {run.vp}  CP {run.cp}  EP {run.ep}  ETP {run.etp}  DP {run.dp} (as it ran)")
    for field, c in published.corrections(row.id).items():
        t.add_row("page differs", f"{field.upper()} {c['run']} in the run, {c['page']} on the page ({c['source']})")
    t.add_row("run settings", f"dispatcher {run.dispatcher}; CUDA graphs {', '.join(run.cuda_graphs) or 'none'}; "
                              f"A2A overlap {'on' if run.a2a_overlap else 'off'}; recompute "
                              f"{', '.join(run.recompute) or 'none'}; parameter gather "
                              f"{'overlapped' if run.overlap_param_gather else 'exposed'}; cross-entropy "
                              f"{run.cross_entropy}")
    if published.run_settings[row.id].note:
        t.add_row("note", published.run_settings[row.id].note)
    t.add_row("virtual stages", f"{'/'.join(map(str, step.chunk_layers))} layers; {step.microbatches} micro-batches")
    t.add_row("tokens/s/GPU", f"{step.tokens_per_s_per_gpu:,.0f} predicted, {row.published_tokens_per_s_per_gpu:,.0f} "
                              f"published ({step.tokens_per_s_per_gpu / row.published_tokens_per_s_per_gpu - 1:+.1%}); "
                              f"role in the protocol: {published.role(row.id)}")
    t.add_row("step", f"{step.step_s:.3f} s; MFU {step.mfu:.1%} (BF16 peak)")
    t.add_row("memory", f"{step.memory_gib:.1f} of {step.capacity_gib:.1f} GiB "
                        f"({'fits' if step.fits else 'does not fit'}): "
                        + ", ".join(f"{k} {v:.1f}" for k, v in step.memory_parts_gib.items()))
    console.print(t)
    terms = Table(title="step time by term (s per step, the slowest stage)", title_justify="left", box=box.SIMPLE_HEAD)
    terms.add_column("term")
    terms.add_column("s", justify="right")
    terms.add_column("share", justify="right")
    for k, v in sorted(step.terms_s.items(), key=lambda kv: -kv[1]):
        if v > 0:
            terms.add_row(k, f"{v:.3f}", f"{v / step.step_s:.1%}")
    console.print(terms)
    console.print("assumptions:", highlight=False)
    for a in step.assumptions:
        console.print(f"  - {escape(a)}", highlight=False)


def plan_cmd(name: str = typer.Argument(..., help="recipe name, alias or YAML file (a published run's id with "
                                                  "--published)", autocompletion=recipe_names),
             overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
             gpus: Optional[int] = typer.Option(None, "--gpus", help="plan for this many GPUs"),
             published: bool = typer.Option(False, "--published", help="NAME is a published run "
                                            "(muse_stack/plan/published/bridge-moe.yaml): its model, system and layout as it ran"),
             json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Validate the layout and estimate memory per GPU, before it costs a GPU-hour."""
    if published:
        from muse_stack.plan.published import load
        from muse_stack.plan.scale import estimate

        if overrides or gpus is not None:
            raise InputError("a published run is planned as published", field="--published", value=name,
                             fix="drop the overrides and --gpus (tune --published searches other layouts)")
        step = estimate(load(), load().run(name))
        if json_out:
            typer.echo(json.dumps(step.model_dump() | {"page_differs": load().corrections(name)}, indent=2))
        else:
            print_published(step)
        if not step.fits:
            raise typer.Exit(1)
        return
    recipe = load_recipe(name, overrides or [])
    resolved = finalize(recipe, gpus=gpus)
    plan, _ = make_plan(resolved)
    # what `run` and `launch` would refuse (the optimizer values are listed as not stated)
    refused = resolved.refusal(values=False)
    if json_out:
        typer.echo(json.dumps({**plan.summary(), "filled": {p: f.model_dump(mode="json")
                                                            for p, f in recipe.filled.items()},
                               "refused": refused.as_dict() if refused is not None else None}, indent=2))
    else:
        print_plan(plan)
        print_filled(recipe)
        if refused is not None:
            console.print(f"[yellow]refused:[/] `run` and `launch` refuse the recipe: {escape(refused.field or '')}: "
                          f"{escape(refused.message)}; fix: {escape(refused.fix or '')}", highlight=False)
    if plan.fits is False:
        raise typer.Exit(1)


def tune_cmd(name: str = typer.Argument(..., help="recipe name, alias or YAML file", autocompletion=recipe_names),
             overrides: Optional[list[str]] = typer.Argument(None, help="key.path=value overrides"),
             gpus: Optional[int] = typer.Option(None, "--gpus", help="tune for this many GPUs"),
             gpu: Optional[str] = typer.Option(None, "--gpu", help=f"GPU type ({', '.join(gpus_of_table())})"),
             top: int = typer.Option(5, "--top", min=1, max=100, help="layouts to print"),
             out: Optional[Path] = typer.Option(None, "--out", help="write the best layout's overrides here, one a line"),
             force: bool = typer.Option(False, "--force", help="replace the --out file if it exists"),
             json_out: bool = typer.Option(False, "--json", help="print JSON"),
             published: bool = typer.Option(False, "--published", help="NAME is a published run: rank its layout "
                                            "among those that fit its GPU count"),
             no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar")) -> None:
    """Search layouts that fit for the fastest predicted step; write the best as overrides."""
    import shlex

    if published:
        from muse_stack.plan.published import load
        from muse_stack.plan.scale import tune

        if overrides or gpus is not None or gpu is not None or out is not None:
            raise InputError("a published run is tuned on its own GPUs", field="--published", value=name,
                             fix="drop the overrides, --gpus, --gpu and --out")
        found = tune(load(), load().run(name))
        rank = next(i for i, c in enumerate(found) if c.published) + 1
        if json_out:
            typer.echo(json.dumps({"layouts": len(found), "published_rank": rank,
                                   "best": [c.model_dump() for c in found[:top]]}, indent=2))
            return
        t = Table(title=f"tune: {name}: the published run's layout ranks {rank} of {len(found)} that fit",
                  title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("rank", "layout", "tokens/s/GPU", "GiB", "largest term"):
            t.add_column(col, justify="right" if col in ("rank", "tokens/s/GPU", "GiB") else "left")
        shown = found[:top] + ([found[rank - 1]] if rank > top else [])
        for c in shown:
            i = found.index(c) + 1
            t.add_row(str(i), c.label() + (" (published)" if c.published else ""), f"{c.tokens_per_s_per_gpu:,.0f}",
                      f"{c.memory_gib:.0f}", c.dominant)
        console.print(t)
        return

    from rich.progress import Progress

    from muse_stack.plan.tune import bounds, search

    extra = list(overrides or []) + (_gpu_overrides(gpu) if gpu is not None else [])
    if out is not None and out.exists() and out.is_dir():
        raise InputError("--out names a directory", field="--out", value=str(out), fix="give a file path")
    if out is not None and out.exists() and not force:
        raise InputError("--out names a file that exists; tune never overwrites one unasked", field="--out",
                         value=str(out), fix="pass --force to replace it, or give another path")
    recipe = load_recipe(name, extra)
    own = gpus is None and gpu is None
    if own:
        make_plan(recipe)  # the recipe itself must pass the rules (errors name the field)
    elif gpus is not None:
        make_plan(recipe, gpus=gpus, strict=False)  # checks the GPU count's range (a usage error names --gpus)
    if no_progress or json_out:
        best, planned = search(recipe, gpus, top=top)
    else:
        with Progress(transient=True, console=console) as bar:
            task = bar.add_task("planning layouts", total=None)

            def step(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            best, planned = search(recipe, gpus, progress=step, top=top)
    best = best[:top]
    if json_out:
        typer.echo(json.dumps({"planned": planned, "best": [c.model_dump() for c in best],
                               "not_searched": bounds(recipe)}, indent=2))
    if not best:
        if planned == 0:
            console.print(f"[red]no layout to plan:[/] no TP x PP x CP of {gpus or recipe.hardware.count} GPUs leaves a "
                          f"data-parallel size that batch.gbs = {recipe.batch.gbs} splits over")
        else:
            console.print(f"[red]no layout of the {planned:,} planned fits[/] (memory, or the rules)")
        if not json_out:
            console.print("not searched: " + "; ".join(bounds(recipe)), highlight=False)
        raise typer.Exit(1)
    if not json_out:
        print_tune(recipe, best, planned, own=own)
    if out is not None:
        atomic.write_text(out, "\n".join(best[0].overrides) + "\n")
        if not json_out:
            console.print(f"wrote {out}: muse-stack run {shlex.quote(name)} $(cat {shlex.quote(str(out))})")


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
    app.command("tune")(tune_cmd)
