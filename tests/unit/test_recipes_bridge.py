"""Megatron-Bridge ConfigContainer keys as override aliases, and `show --bridge`."""

from __future__ import annotations

import pytest

from muse_stack.cli import main
from muse_stack.util.errors import RecipeError
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes.bridge import BRIDGE_KEYS, _recipe_fields
from muse_stack.recipes.catalogue import load_recipe, recipe_yaml


def test_every_bridge_key_names_a_real_recipe_field():
    fields = set(_recipe_fields())
    for key, field in BRIDGE_KEYS.items():
        if field.startswith("model.overrides."):
            assert field.removeprefix("model.overrides.") in ModelConfig.model_fields, key
        else:
            assert field in fields, key


@pytest.mark.parametrize("bridge, ours", [
    ("train.global_batch_size=64", "batch.gbs=64"),
    ("train.micro_batch_size=2", "batch.mbs=2"),
    ("model.tensor_model_parallel_size=8", "layout.tp=8"),
    ("model.expert_model_parallel_size=16", "layout.ep=16"),
    ("optimizer.lr=3e-5", "optimizer.lr=3e-5"),
    ("optimizer.adam_beta2=0.95", "optimizer.beta2=0.95"),
    ("scheduler.lr_warmup_iters=10", "optimizer.warmup_steps=10"),
    ("train.train_iters=7", "training.steps=7"),
    ("rng.seed=5", "training.seed=5"),
    ("model.recompute_granularity=selective", "recompute.granularity=selective"),
    ("model.num_layers=4", "model.overrides.num_hidden_layers=4"),
    ("peft.dim=16", "peft.rank=16"),
])
def test_bridge_override_is_the_same_as_the_recipe_field(bridge, ours):
    recipe = "lora-64" if bridge.startswith("peft.") else "sft-192"
    assert recipe_yaml(load_recipe(recipe, [bridge])) == recipe_yaml(load_recipe(recipe, [ours]))
    assert recipe_yaml(load_recipe(recipe, [bridge])) != recipe_yaml(load_recipe(recipe))


@pytest.mark.parametrize("key, nearest", [
    ("train.global_batch_sise", "batch.gbs"),
    ("model.tensor_model_paralel_size", "layout.tp"),
    ("scheduler.lr_warmup_iter", "optimizer.warmup_steps"),
])
def test_unknown_bridge_key_is_refused_naming_the_nearest_field(key, nearest):
    with pytest.raises(RecipeError) as exc:
        load_recipe("sft-192", [f"{key}=1"])
    assert exc.value.exit_code == 2 and key in exc.value.render() and nearest in exc.value.fix


def test_recipe_fields_and_free_mappings_still_apply():
    r = load_recipe("sft-192", ["layout.ep=16", "model.overrides.num_hidden_layers=4", "env.FOO=bar"])
    assert r.layout.ep == 16 and r.model.overrides["num_hidden_layers"] == 4 and r.env["FOO"] == "bar"


def test_show_bridge_prints_the_table_with_values(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["show", "sft-192", "--bridge"]) == 0
    out = capsys.readouterr().out
    for key, field in BRIDGE_KEYS.items():
        assert key in out and field in out
    r = load_recipe("sft-192")
    assert f"layout.tp = {r.layout.tp}" in out and f"batch.gbs = {r.batch.gbs}" in out
    assert max(len(line) for line in out.splitlines()) <= 80
