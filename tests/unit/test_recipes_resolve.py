"""The recipe resolved and validated once (muse_stack/resolve/recipe.py): what it holds, and that
`list`, `run --dry-run` and `launch` refuse what the engine would refuse at start-up, naming the
fields, before anything is written."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from muse_stack.recipes.catalogue import load_recipe
from muse_stack.models.muse_spark.peft_config import resolve as resolve_peft
from muse_stack.resolve.recipe import finalize, resolve
from muse_stack.util.errors import LayoutError, RecipeError

ROOT = Path(__file__).resolve().parents[2]

#: the Bridge seeds whose sources leave sizes the megatron engine starts from unstated, and those sizes
UNSTATED = {
    "sft-192-mm": ["batch.mbs", "batch.gbs", "batch.seq_length"],
    "pretrain-192": ["batch.mbs", "batch.gbs", "batch.seq_length"],
    "pretrain-256": ["batch.mbs", "batch.gbs", "batch.seq_length"],
    "sft-192-32k": ["batch.gbs"],
    "sft-192-coderforge-64k": ["batch.gbs"],
    "lora-16-mm": ["batch.mbs", "batch.gbs", "batch.seq_length", "layout.cp"],
}


@pytest.mark.parametrize("name", sorted(UNSTATED))
def test_a_recipe_leaving_a_size_unstated_is_refused_naming_every_field(name):
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe(name))
    err = exc.value
    assert err.field == UNSTATED[name][0] and err.exit_code == 2
    assert all(f in err.message and f"{f}=N" in err.fix for f in UNSTATED[name])
    assert "not stated by the source" in err.message  # the recipe's own note says why


@pytest.mark.parametrize("name", sorted(UNSTATED))
def test_list_says_the_recipe_does_not_run_why_and_what_to_pass(name, cli):
    rc, out, _ = cli("list", "--json")
    row = {r["name"]: r for r in json.loads(out)}[name]
    assert rc == 0 and row["runs"] == "no"
    assert row["refused"].startswith(f"{UNSTATED[name][0]}: ") and "unstated" in row["refused"]
    assert all(f"{f}=N" in row["fix"] for f in UNSTATED[name])
    rc, text, _ = cli("list")
    line = " ".join(text.split())
    assert f"{name} does not run as written: {UNSTATED[name][0]}:" in line
    assert " ".join(f"{f}=N" for f in UNSTATED[name]) in line


@pytest.mark.parametrize("name", sorted(UNSTATED))
def test_run_dry_run_and_launch_refuse_before_anything_is_written(name, cli, tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("run", name, "--out", out, "--dry-run")
    assert rc == 2 and UNSTATED[name][0] in err and "fix:" in err and not out.exists()
    job = tmp_path / "job.sbatch"
    rc, _, err = cli("launch", name, "--slurm", "-o", job)
    assert rc == 2 and UNSTATED[name][0] in err and not job.exists()


def test_a_cpu_run_without_its_global_batch_is_refused_before_its_run_directory(cli, tmp_path):
    """The engine used to refuse this only once the run directory and the data build existed."""
    out = tmp_path / "run"
    rc, _, err = cli("run", "tiny-cpu", "batch.gbs=null", "--out", out, "--no-progress")
    assert rc == 2 and "batch.gbs" in err and not out.exists()


def test_the_stated_sizes_resolve_and_the_global_batch_splits_once():
    r = resolve(load_recipe("sft-192-32k", ["batch.gbs=8"]))  # TP4 x PP6 x CP2 on 192: DP 4
    assert (r.world, r.dp, r.micro_batches) == (192, 4, 2)
    with pytest.raises(LayoutError) as exc:
        resolve(load_recipe("sft-192-32k", ["batch.gbs=6"]))
    assert exc.value.field == "batch.gbs" and "GBS divisible by MBS x DP = 1 x 4 = 4" in exc.value.rule


def test_the_resolved_recipe_holds_what_the_engines_and_the_planner_read():
    recipe = load_recipe("lora-64")
    r = finalize(recipe)
    assert r.recipe is recipe and r.model == recipe.model_config_resolved()
    assert r.peft == resolve_peft(recipe.peft, r.model) and r.towers is None
    # TP4 x PP4 on 64 GPUs: DP 4; GBS 128 of MBS 1: 32 micro-batches per replica; 62 layers as 15/16/16/15
    assert (r.world, r.dp, r.micro_batches, r.stages) == (64, 4, 32, (15, 16, 16, 15))
    mm = finalize(load_recipe("tiny-cpu-mm"))
    assert mm.towers == mm.recipe.towers_config_resolved()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.micro_batches = 1  # type: ignore[misc]


def test_filled_values_carry_their_source():
    r = finalize(load_recipe("tiny-cpu", ["peft.scheme=lora", "peft.targets=[self_attn.q_proj]"]))
    filled = r.filled
    assert filled["peft.rank"].value == 32 and "LoRA/DoRA defaults" in filled["peft.rank"].source
    assert all(path in filled for path in r.recipe.filled)


def test_settings_of_another_engine_are_refused_by_the_resolve_step_not_by_the_schema():
    recipe = load_recipe("tiny-cpu", ["optimizer.precision_aware=true"])  # read and shown
    with pytest.raises(RecipeError) as exc:
        resolve(recipe)
    assert exc.value.field == "optimizer.precision_aware" and "megatron engine only" in exc.value.render()


def _imports(path: Path) -> set[str]:
    """The muse_stack modules one file imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # `from package import module` names the module
                sub = Path(ROOT, *f"{node.module}.{alias.name}".split("."))
                found.add(f"{node.module}.{alias.name}" if sub.with_suffix(".py").is_file() or sub.is_dir()
                          else node.module)
    return {m for m in found if m.startswith("muse_stack.")}


def test_no_module_of_the_package_imports_itself_back():
    """The import graph of muse_stack has no cycle (recipes/schema.py and recipes/engines.py imported
    each other while the recipe was validated in both)."""
    graph = {}
    for path in (ROOT / "muse_stack").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = _imports(path) - {name}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:  # depth first; a module met again on its own trail closes a cycle
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*trail[trail.index(nxt):], nxt])
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
