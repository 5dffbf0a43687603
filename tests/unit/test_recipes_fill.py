"""The named fill policy: optimizer values a recipe leaves unstated come from Megatron-Bridge
0.6.2's common recipe for its kind, each recorded with its source; an override wins; what
neither the recipe nor Bridge states stays refused; a machine that cannot run the recipe says
so before any optimizer refusal."""

from __future__ import annotations

import json

import pytest

import muse_stack.engines.megatron_available as megatron_available
import muse_stack.run.availability as availability
from muse_stack.compare.classify import INFORMATIONAL, NUMERICS, classify
from muse_stack.compare.diff import diff_documents
from muse_stack.resolve.recipe import resolve
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.bridge_defaults import KINDS, WHEEL
from muse_stack.recipes.catalogue import load_recipe, parse_recipe, recipe_yaml

FIELDS = ("name", "lr", "min_lr", "warmup_steps", "decay_style", "weight_decay", "clip_grad", "beta1", "beta2", "eps")

# the values as read from megatron_bridge-0.6.2-py3-none-any.whl, recipes/common.py and
# recipes/utils/optimizer_utils.py (weight decay: the scheduler's constant 0.033, which
# megatron-core's OptimizerParamScheduler sets on every step)
FROM_WHEEL = {
    "pretrain": (3e-4, 3e-5, 500, 0.95),
    "sft": (5e-6, 0.0, 50, 0.98),
    "peft": (1e-4, 0.0, 50, 0.98),
    "sft_vlm": (3e-4, 3e-5, 500, 0.95),
    "peft_vlm": (1e-4, 1e-5, 500, 0.95),
}


@pytest.mark.parametrize("kind", list(FROM_WHEEL))
def test_the_table_holds_the_wheels_values(kind):
    lr, min_lr, warmup, beta2 = FROM_WHEEL[kind]
    v = KINDS[kind]["values"]
    assert (v["lr"], v["min_lr"], v["warmup_steps"], v["beta2"]) == (lr, min_lr, warmup, beta2)
    assert (v["name"], v["decay_style"], v["weight_decay"], v["clip_grad"], v["beta1"], v["eps"]) == \
        ("adam", "cosine", 0.033, 1.0, 0.9, 1e-8)
    assert WHEEL["version"] == "0.6.2" and len(WHEEL["sha256"]) == 64


def test_sft_192_states_no_optimizer_value_and_gets_bridge_sft_defaults():
    recipe = load_recipe("sft-192")
    assert set(recipe.filled) == {f"optimizer.{f}" for f in FIELDS if f != "name"}  # name: adam is in the schema
    for path, f in recipe.filled.items():
        assert getattr(recipe.optimizer, path.split(".")[1]) == f.value
        assert "megatron.bridge.recipes.common._sft_common" in f.source and "0.6.2" in f.source
        assert WHEEL["sha256"][:12] in f.source
    assert recipe.optimizer.lr == 5e-6 and recipe.optimizer.beta2 == 0.98 and recipe.optimizer.weight_decay == 0.033
    resolve(recipe)  # nothing left unstated


@pytest.mark.parametrize("name, kind", [("pretrain-192", "pretrain"), ("lora-64", "peft"),
                                        ("sft-192-mm", "sft_vlm"), ("lora-16-mm", "peft_vlm"),
                                        ("sft-192-32k", "sft")])
def test_each_kind_takes_its_own_common_recipe(name, kind):
    recipe = load_recipe(name)
    assert recipe.filled
    assert all(f"._{KINDS[kind]['function'].lstrip('_')} " in f.source for f in recipe.filled.values())
    stated = load_recipe(name, ["fill_policy=none"]).optimizer
    for path, f in recipe.filled.items():
        assert getattr(stated, path.split(".")[1]) is None  # only what the recipe leaves unstated
        if path != "optimizer.warmup_steps":
            assert f.value == KINDS[kind]["values"][path.split(".")[1]]


def test_an_override_wins_and_is_not_recorded_as_filled():
    recipe = load_recipe("sft-192", ["optimizer.lr=1e-5", "optimizer.beta2=0.95"])
    assert recipe.optimizer.lr == 1e-5 and recipe.optimizer.beta2 == 0.95
    assert "optimizer.lr" not in recipe.filled and "optimizer.beta2" not in recipe.filled
    assert recipe.filled["optimizer.min_lr"].value == 0.0


def test_an_override_of_a_resolved_recipe_drops_the_stale_fill_record():
    resolved = load_recipe("sft-192").model_dump(mode="json")
    assert parse_recipe(resolved, "x").filled.keys() == load_recipe("sft-192").filled.keys()  # round trip
    resolved["optimizer"]["lr"] = 2e-5
    assert "optimizer.lr" not in parse_recipe(resolved, "x").filled


def test_warmup_longer_than_the_run_is_capped_as_bridge_caps_it():
    recipe = load_recipe("sft-192", ["training.steps=20"])
    assert recipe.optimizer.warmup_steps == 19 and "capped" in recipe.filled["optimizer.warmup_steps"].source


def test_a_stated_warmup_fraction_is_not_joined_by_filled_steps():
    recipe = load_recipe("sft-192", ["optimizer.warmup_fraction=0.1"])
    assert recipe.optimizer.warmup_steps is None and "optimizer.warmup_steps" not in recipe.filled


def test_a_filled_min_lr_above_a_stated_lr_is_refused_naming_it():
    with pytest.raises(RecipeError) as exc:
        load_recipe("pretrain-192", ["optimizer.lr=1e-5", "optimizer.min_lr=null"])
    assert exc.value.field == "optimizer.min_lr" and "filled" in exc.value.message and exc.value.fix


def test_what_neither_the_recipe_nor_bridge_states_stays_refused_in_one_round():
    # a benchmark recipe has no Bridge kind: nothing is filled
    recipe = load_recipe("slice-1gpu", ["optimizer.lr=null"])
    assert not recipe.filled
    with pytest.raises(RecipeError) as exc:
        resolve(recipe)
    assert "optimizer.lr" in exc.value.message
    # fill_policy none: every unstated value named at once, min_lr with them
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe("sft-192", ["fill_policy=none"]))
    for f in ("lr", "min_lr", "decay_style", "weight_decay", "clip_grad", "warmup_steps", "beta1", "beta2", "eps"):
        assert f"optimizer.{f}" in exc.value.message


def test_show_prints_each_filled_value_with_its_source(cli):
    rc, out, _ = cli("show", "sft-192")
    assert rc == 0 and "filled:" in out and "optimizer.lr:" in out and out.count("_sft_common") == 9
    rc, out, _ = cli("show", "sft-192", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["filled"]["optimizer.lr"]["value"] == 5e-6 and doc["optimizer"]["lr"] == 5e-6
    rc, out, _ = cli("plan", "sft-192")
    assert "filled:" in out and "not stated:" not in out


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(megatron_available, "missing", lambda: "CUDA is not available on this machine")
    monkeypatch.setattr(availability, "_cuda_devices", lambda: 0)


@pytest.mark.parametrize("extra", [[], ["fill_policy=none"]])
def test_run_on_a_cpu_says_the_hardware_first(no_gpu, cli, tmp_path, monkeypatch, extra):
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli("run", "sft-192", *extra)
    assert rc == 2 and "CUDA" in err and "192 GB200 GPUs" in err
    assert "unstated" not in err and "optimizer." not in err
    assert not (tmp_path / "runs").exists()


def test_diff_classifies_filled_records_informational_and_values_numerics():
    a = {"recipe": load_recipe("sft-192").model_dump(mode="json")}
    b = {"recipe": load_recipe("sft-192", ["optimizer.lr=5e-6"]).model_dump(mode="json")}
    report = diff_documents(a, b)
    assert report.differences and all(d.cls == INFORMATIONAL for d in report.differences)  # same value, stated
    assert classify("recipe.filled.optimizer.lr.source") == INFORMATIONAL
    assert classify("recipe.fill_policy") == INFORMATIONAL
    c = {"recipe": load_recipe("sft-192", ["optimizer.lr=1e-5"]).model_dump(mode="json")}
    assert diff_documents(a, c).exit_code == 2 and classify("recipe.optimizer.lr") == NUMERICS
    assert recipe_yaml(load_recipe("sft-192")).count("_sft_common") == 9
