"""Recipes ask for what the engines do, or are refused before a run writes anything."""

from __future__ import annotations

import pytest

from muse_stack.resolve.recipe import resolve
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe

RUNNABLE = ["attune-b200", "pretrain-192", "pretrain-256", "sft-192", "sft-256", "sft-192-32k",
            "sft-192-coderforge-64k", "proxy-1gpu", "proxy-2gpu", "proxy-8gpu", "proxy-8gpu-pp2",
            "slice-1gpu", "tiny-cpu", "tiny-cpu-mm"]
#: the batch sizes (and layout) these recipes' sources leave unstated, which the engine needs stated
#: (test_recipes_resolve.py): given here so that the rest of each recipe is checked
SIZES = {"pretrain-192": ["batch.mbs=1", "batch.gbs=32", "batch.seq_length=4096"],
         "pretrain-256": ["batch.mbs=1", "batch.gbs=32", "batch.seq_length=4096"],
         "sft-192-32k": ["batch.gbs=4"], "sft-192-coderforge-64k": ["batch.gbs=2"],
         "sft-192-mm": ["batch.mbs=1", "batch.gbs=32", "batch.seq_length=4096"],
         "lora-16-mm": ["layout.cp=1", "batch.mbs=1", "batch.gbs=4", "batch.seq_length=4096"]}


# the optimizer values the recipes' sources leave unstated (any stated values do)
STATE_ALL = ["optimizer.lr=1e-5", "optimizer.min_lr=1e-6", "optimizer.decay_style=cosine", "optimizer.warmup_steps=5",
             "optimizer.weight_decay=0.1", "optimizer.clip_grad=1.0", "optimizer.beta1=0.9", "optimizer.beta2=0.95",
             "optimizer.eps=1e-8"]
STATED_AS_WRITTEN = {"proxy-1gpu", "proxy-2gpu", "proxy-8gpu", "proxy-8gpu-pp2", "slice-1gpu", "tiny-cpu",
                     "tiny-cpu-mm"}


@pytest.mark.parametrize("name", RUNNABLE)
def test_catalogue_recipes_that_train_as_written_pass(name):
    sizes = SIZES.get(name, [])
    resolve(load_recipe(name, sizes))  # unstated optimizer values filled by the fill policy (test_recipes_fill.py)
    recipe = load_recipe(name, [*sizes, "fill_policy=none"])
    if name in STATED_AS_WRITTEN:
        resolve(recipe)
        return
    # without the fill policy, a source that leaves optimizer values unstated is refused, naming them
    with pytest.raises(RecipeError) as exc:
        resolve(recipe)
    assert exc.value.field.startswith("optimizer.") and "unstated" in exc.value.message
    stated = {o.split("=")[0] for o in STATE_ALL if getattr(recipe.optimizer, o.split("=")[0].split(".")[1]) is not None}
    if recipe.optimizer.warmup_fraction is not None:  # the warm-up is stated as a fraction: steps would state it twice
        stated.add("optimizer.warmup_steps")
    resolve(load_recipe(name, [*sizes, "fill_policy=none", *(o for o in STATE_ALL if o.split("=")[0] not in stated)]))


@pytest.mark.parametrize("field", ["lr", "beta1", "beta2", "eps", "clip_grad", "weight_decay", "warmup_steps",
                                   "decay_style"])
def test_each_unstated_training_value_is_refused_by_name(field, cli, tmp_path):
    """No silent defaults: without a fill policy, run and launch refuse, naming the field, before
    anything is written."""
    overrides = [f"optimizer.{field}=null", "fill_policy=none"]
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe("tiny-cpu", overrides))
    assert f"optimizer.{field}" in exc.value.message
    out = tmp_path / "run"
    rc, _, err = cli("run", "tiny-cpu", *overrides, "--out", out)
    assert rc == 2 and f"optimizer.{field}" in err and not out.exists()
    rc, _, err = cli("launch", "tiny-cpu", "--slurm", *overrides, "-o", tmp_path / "job.sbatch")
    assert rc == 2 and f"optimizer.{field}" in err and not (tmp_path / "job.sbatch").exists()
    rc, text, _ = cli("plan", "tiny-cpu", *overrides)
    assert rc == 0 and "not stated:" in text and f"optimizer.{field}" in text


@pytest.mark.parametrize("name, overrides, field", [
    ("lora-64", ["layout.etp=2"], "layout.etp"),  # expert adapters are whole on every ETP rank
    ("sft-192-mm", ["frozen=[audio_tower,model.language_model.norm]"], "frozen"),  # freezes towers only
    ("lora-64", ["peft.targets=[self_attn.q_proj,self_attn.qkv_proj]"], "peft.targets"),
    ("tiny-cpu", ["peft.scheme=lora"], "peft.targets"),
    ("tiny-cpu", ["frozen=[base]"], "frozen"),
    ("miles-h200-64", [], "offload.optimizer"),
    ("sft-192", ["frozen=[model.language_model.embed_tokens]"], "frozen"),
    ("proxy-2gpu", ["layout.ep=1", "layout.pp=2", "layout.vpp=2"], "layout.vpp"),
    ("proxy-2gpu", ["recompute.granularity=selective", "recompute.modules=[mlp]"], "recompute.modules"),
    ("tiny-cpu", ["layout.tp=2", "hardware.count=2"], "layout.tp"),
    ("tiny-cpu", ["layout.ep=2", "hardware.count=2"], "layout.ep"),
    ("tiny-cpu", ["recompute.granularity=full"], "recompute.granularity"),
    ("tiny-cpu", ["offload.activations=true"], "offload.activations"),
])
def test_what_an_engine_would_not_train_as_written_is_refused(name, overrides, field):
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe(name, overrides))
    assert exc.value.field == field and exc.value.fix


def test_perception_towers_may_stay_frozen_on_either_engine():
    resolve(load_recipe("tiny-cpu", ["frozen=[vision_tower,audio_tower]"]))
    resolve(load_recipe("sft-192", ["frozen=[vision_tower,audio_tower]", *STATE_ALL]))


def test_the_reference_engine_freezes_by_parameter_name():
    resolve(load_recipe("tiny-cpu", ["frozen=[model.language_model.embed_tokens]"]))


def test_run_refuses_an_adapter_recipe_it_cannot_train_and_writes_nothing(tmp_path, cli):
    out = tmp_path / "lora"
    rc, _, err = cli("run", "lora-64", "layout.etp=2", "--out", out, "--no-progress")
    assert rc == 2 and not out.exists()
    assert "layout.etp" in err and "peft.targets" in err  # names the field and both fixes


def test_the_multimodal_seeds_pass_the_megatron_engine_check_and_reach_the_machine_check(cli, tmp_path):
    """The megatron engine places the towers on its first pipeline stage: both image-text seeds
    pass the engine's check once the sizes their sources leave unstated are given, and on this CPU
    `run` stops at the machine, writing nothing."""
    for name in ("lora-16-mm", "sft-192-mm"):
        resolve(load_recipe(name, [*SIZES[name], *STATE_ALL]))
    out = tmp_path / "mm"
    rc, _, err = cli("run", "sft-192-mm", *SIZES["sft-192-mm"], *STATE_ALL, "--out", out, "--no-progress")
    assert rc == 2 and "192 GB200 GPUs" in err and "towers" not in err and not out.exists()
