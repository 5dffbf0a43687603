"""The engine option table (muse_stack/recipes/options.py): every row has a blocker, a planner entry and an
install; the recipe's section is the table's keys; engine_steps.py's attribution flags are the table's; the
planner's entry of each row is what the plan does; the sections the options were in before still load, with a
warning naming the new key. CPU only (the engine's modules, which import megatron-core, are read as source)."""

from __future__ import annotations

import ast
import copy
import json
import warnings
from pathlib import Path

import pytest
import yaml
from bench_results import script

from muse_stack.plan.cost import StepKernels
from muse_stack.plan.planner import make_plan
from muse_stack.recipes import options
from muse_stack.recipes.catalogue import load_recipe, parse_recipe, raw_recipe
from muse_stack.recipes.options import BY_KEY, CONFIGS, ROWS, Install, Priced, Unpriced, check, resolve
from muse_stack.recipes.schema import EngineOptions, Recipe
from muse_stack.util.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]


def _functions(module: str) -> dict[str, list[str]]:
    """The top-level functions of a module of the package and their parameters, read from its source."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    return {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}


@pytest.mark.parametrize("row", ROWS, ids=[r.key for r in ROWS])
def test_every_row_has_a_blocker_a_planner_entry_an_install_and_an_attribution(row):
    recipe = load_recipe("slice-1gpu")
    block = row.blocker(recipe, {})
    assert block is None or (isinstance(block, options.Block) and block.reason)
    assert isinstance(row.prices, (Priced, Unpriced))
    assert (row.prices.where if isinstance(row.prices, Priced) else row.prices.why).strip()
    install = row.install
    assert isinstance(install, Install) and (install.config or install.module), row.key
    if install.config is not None:
        assert install.config[0] in CONFIGS and install.config[1]
    if install.module is not None:  # install_<key>(target, on) in the module beside its kernel, at a stage
        assert install.stage in ("model", "optimizer")
        params = _functions(install.module).get(f"install_{row.key}")
        assert params is not None and len(params) == 2 and params[1] == "on", row.install_function
    else:
        assert install.stage is None
    assert row.attribution and all(a.label and a.what for a in row.attribution)
    assert row.default in ("on", "off") and row.description and row.engines


def test_the_planner_entries_name_the_kernels_the_planner_prices():
    kernels = {r.prices.kernel: (r.prices.on, r.prices.off) for r in ROWS
               if isinstance(r.prices, Priced) and r.prices.kernel is not None}
    assert set(kernels) == set(StepKernels.model_fields)
    for field, values in kernels.items():
        allowed = set(StepKernels.model_fields[field].annotation.__args__)
        assert set(values) <= allowed, field


def test_the_recipe_section_is_the_table():
    assert list(EngineOptions.model_fields) == [r.key for r in ROWS]
    for r in ROWS:
        info = EngineOptions.model_fields[r.key]
        assert info.default is None and info.description == r.description
    assert "engine_options" in Recipe.model_fields
    assert not {"fusions", "performance"} & set(Recipe.model_fields)


def test_engine_steps_flags_are_the_tables_attributions():
    engine_steps = script("engine_steps")
    own = {"--steps", "--warmup", "--out", "--help", "-h"}
    flags = {s for a in engine_steps.parser()._actions for s in a.option_strings} - own
    assert flags == set(options.attribution_flags())
    args = engine_steps.parser().parse_args(["slice-1gpu", "--te-adam", "--late-counts"])
    assert engine_steps.attributed(args) == {"--te-adam": "engine_options.triton_adam=false",
                                            "--late-counts": "engine_options.early_expert_counts=false"}
    both = engine_steps.parser().parse_args(["slice-1gpu", "--compiled-norm-backward", "--fused-norm-backward"])
    with pytest.raises(SystemExit, match="both ways"):
        engine_steps.attributed(both)


@pytest.mark.parametrize("flag", list(options.attribution_flags()))
def test_each_attribution_runs_on_the_slice(flag):
    """h200.sh attributes each option on slice-1gpu, and an option of the perception towers on slice-1gpu-mm: each
    flag's override is a recipe the engine check accepts."""
    row, attribution = options.attribution_flags()[flag]
    name = "slice-1gpu" if row.blocker(load_recipe("slice-1gpu"), {}) is None else "slice-1gpu-mm"
    recipe = load_recipe(name, [row.override(attribution.value)])
    check(recipe)
    assert resolve(recipe)[row.key].value is attribution.value


def _plan_figures(recipe) -> tuple:
    plan, _ = make_plan(recipe, strict=False)
    return (json.dumps(plan.time.terms_s, sort_keys=True), plan.time.step_s,
            tuple(m.total_gib for m in plan.memory))


#: one GPU, a data-parallel one (a gradient reduce to overlap), and one with the perception towers
PLANNED = ("slice-1gpu", "proxy-2gpu", "slice-1gpu-mm")


def test_the_planner_entry_of_each_row_is_what_the_plan_does():
    """A priced option changes the plan where it changes what runs; an unpriced one changes it only through a
    priced option whose blocker it is (the Adam update under the optimizer's CUDA graph)."""
    base = {name: load_recipe(name) for name in PLANNED}
    figures = {name: _plan_figures(r) for name, r in base.items()}
    for row in ROWS:
        moved = False
        for attribution in row.attribution:
            for name, recipe in base.items():
                flipped = load_recipe(name, [row.override(attribution.value)])
                if resolve(flipped)[row.key].value == resolve(recipe)[row.key].value:
                    continue  # the flag sets what already runs (or cannot apply here)
                changed = _plan_figures(flipped) != figures[name]
                priced_moved = [r.key for r in ROWS if isinstance(r.prices, Priced) and r.key != row.key
                                 and resolve(flipped)[r.key].value != resolve(recipe)[r.key].value]
                if isinstance(row.prices, Unpriced):
                    assert not changed or priced_moved, (row.key, name)
                moved |= changed
        if isinstance(row.prices, Priced):
            assert moved, row.key


def test_resolution_stated_default_and_blocked():
    r = resolve(load_recipe("slice-1gpu", ["engine_options.permute=false", "optimizer.param_remainders=true"]))
    assert (r["permute"].value, r["permute"].source) == (False, "stated")
    assert (r["router"].value, r["router"].source) == (False, "unset: off")
    assert (r["gradient_accumulation"].value, r["gradient_accumulation"].source) == (True, "unset: on")
    assert r["triton_adam"].value is False and "param_remainders" in r["triton_adam"].source
    assert r["triton_adam"].why_off("triton_adam") == r["triton_adam"].block.reason
    assert r["permute"].why_off("permute") == "engine_options.permute: false"
    refused = load_recipe("slice-1gpu", ["engine_options.triton_adam=true", "optimizer.param_remainders=true"])
    assert resolve(refused)["triton_adam"].value is False
    with pytest.raises(RecipeError) as err:
        check(refused)
    assert err.value.field == "engine_options.triton_adam" and "drop engine_options.triton_adam" in err.value.fix
    assert resolve(load_recipe("tiny-cpu")) == {}  # the reference engine reads none


def test_the_config_fields_are_the_options_that_are_megatron_core_fields():
    recipe = load_recipe("slice-1gpu", ["engine_options.router=true"])
    fields = {c: options.config_fields(resolve(recipe), c) for c in CONFIGS}
    assert fields == {"transformer": {"gradient_accumulation_fusion": True, "moe_permute_fusion": True,
                                      "moe_router_fusion": True},
                      "ddp": {"overlap_grad_reduce": False}, "optimizer": {"optimizer_cuda_graph": False}}


def test_the_bridge_keys_of_the_config_options_apply():
    recipe = load_recipe("slice-1gpu", ["model.moe_permute_fusion=false", "ddp.overlap_grad_reduce=true",
                                        "optimizer.optimizer_cuda_graph=true"])
    eo = recipe.engine_options
    assert (eo.permute, eo.overlap_grad_reduce, eo.optimizer_cuda_graph) == (False, True, True)


# ---- the sections the options were in before --------------------------------------------------------
def _old_form(name: str) -> dict:
    """A catalogue recipe with its options in the sections they were in before engine_options."""
    _, data = raw_recipe(name)
    data = dict(data)
    moved = data.pop("engine_options") or {}
    for key, value in moved.items():
        data.setdefault(BY_KEY[key].formerly, {})[key] = value
    data["performance"] = {"triton_adam": False}
    data["notes"] = {**data.get("notes", {}), "fusions.compile_elementwise": "why"}
    return data


def test_a_recipe_in_the_old_sections_loads_as_the_new_one_with_a_warning():
    with pytest.warns(FutureWarning) as caught:
        old = parse_recipe(_old_form("slice-1gpu"), "old.yaml")
    text = " ".join(str(w.message) for w in caught)
    assert "fusions.compile_elementwise is deprecated" in text and "write engine_options.compile_elementwise" in text
    assert "performance.triton_adam is deprecated" in text
    new = load_recipe("slice-1gpu", ["engine_options.triton_adam=false"])
    assert old.engine_options == new.engine_options
    assert old.notes["engine_options.compile_elementwise"] == "why" and "fusions.compile_elementwise" not in old.notes
    dumped = yaml.safe_load(yaml.safe_dump(old.model_dump(mode="json")))
    assert "fusions" not in dumped and "performance" not in dumped


def test_an_override_of_an_old_key_applies_to_the_new_one_with_a_warning():
    with pytest.warns(FutureWarning, match="write engine_options.first_micro_batch_writes"):
        recipe = load_recipe("slice-1gpu", ["performance.first_micro_batch_writes=false"])
    assert recipe.engine_options.first_micro_batch_writes is False


def test_the_old_sections_refuse_what_was_never_in_them_and_disagreements():
    data = _old_form("slice-1gpu")
    data["fusions"] = {"triton_adam": True}  # a performance key under fusions
    with pytest.raises(RecipeError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        parse_recipe(data, "old.yaml")
    assert err.value.field == "fusions.triton_adam" and "engine_options" in err.value.fix
    data = _old_form("slice-1gpu")
    data["engine_options"] = {"triton_adam": True}  # stated both ways
    with pytest.raises(RecipeError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        parse_recipe(data, "old.yaml")
    assert err.value.field == "engine_options.triton_adam" and "state it once" in err.value.fix


def test_a_recorded_run_in_the_old_sections_compares_equal_without_a_warning(tmp_path):
    from muse_stack.compare.runs import read_recipe

    recorded = load_recipe("slice-1gpu").model_dump(mode="json")
    old = copy.deepcopy(recorded)
    old["fusions"] = {"compile_elementwise": old["engine_options"].pop("compile_elementwise")}
    old["performance"] = {}
    old.pop("engine_options")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        data = read_recipe(tmp_path)
    assert data["engine_options"] == {"compile_elementwise": True} and "fusions" not in data
    assert parse_recipe(data, "recipe.yaml") == parse_recipe(recorded, "recipe.yaml")


def test_show_prints_each_option_and_where_its_value_came_from(capsys, monkeypatch):
    from muse_stack.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["show", "slice-1gpu", "--options", "layout.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "engine_options.compile_elementwise = true" in out and "stated" in out
    assert "engine_options.embedding_into_main_grad = false" in out and "split over layout.tp" in " ".join(out.split())
    assert all(f"engine_options.{r.key} = " in out for r in ROWS)
    assert max(len(line) for line in out.splitlines()) <= 80


def test_a_run_started_before_the_change_resumes_as_it_was(tmp_path):
    """A run directory whose recipe.yaml was written with the old sections (its fingerprint hashes those bytes)
    resumes without --allow-change: read into the new form, it is the recipe the run started with."""
    import hashlib

    from muse_stack.run.resume import plan_resume

    doc = load_recipe("tiny-cpu").model_dump(mode="json")
    old = {("fusions" if k == "engine_options" else k): v for k, v in doc.items()}
    old["fusions"], old["performance"] = {"compile_elementwise": None}, {"triton_adam": None}
    text = yaml.safe_dump(old, sort_keys=False)
    (tmp_path / "recipe.yaml").write_text(text)
    (tmp_path / "fingerprint.json").write_text(json.dumps(
        {"run_inputs": {"recipe_sha256": hashlib.sha256(text.encode()).hexdigest()}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan = plan_resume(tmp_path, [], allow_change=False)
    assert plan.change is None and plan.recipe == load_recipe("tiny-cpu")
    (tmp_path / "recipe.yaml").write_text(text.replace("steps: ", "steps: 1", 1))  # edited since: refused
    with pytest.raises(Exception, match="resuming would change"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plan_resume(tmp_path, [], allow_change=False)
