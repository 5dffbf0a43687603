from __future__ import annotations

import json

import pytest
import yaml

from muse_stack.util.errors import RecipeError
from muse_stack.models.muse_spark.config import MUSE_SPARK_OPEN, ModelConfig
from muse_stack.recipes.catalogue import load_recipe, recipe_names, recipe_yaml
from muse_stack.recipes.openrecipes import import_record, read_record_file, recipe_to_record

GB200 = {
    "pretrain-192": "muse_spark_open_pretrain_192gpu_gb200_bf16_config",
    "pretrain-256": "muse_spark_open_pretrain_256gpu_gb200_bf16_config",
    "sft-192": "muse_spark_open_sft_192gpu_gb200_bf16_config",
    "sft-256": "muse_spark_open_sft_256gpu_gb200_bf16_config",
    "sft-192-32k": "muse_spark_open_sft_192gpu_gb200_bf16_long_context_config",
    "sft-192-coderforge-64k": "muse_spark_open_sft_192gpu_gb200_bf16_coderforge_64k_config",
    "lora-64": "muse_spark_open_peft_64gpu_gb200_bf16_config",
    "lora-16-mm": "muse_spark_open_peft_16gpu_gb200_bf16_multimodal_config",
    "sft-192-mm": "muse_spark_open_sft_192gpu_gb200_bf16_multimodal_config",
}


def test_catalogue_has_every_recipe():
    names = set(recipe_names())
    assert set(GB200) | {"attune-b200", "miles-h200-64", "tiny-cpu", "proxy-1gpu", "proxy-2gpu"} <= names


@pytest.mark.parametrize("alias,function", sorted(GB200.items()))
def test_gb200_recipes_by_alias_and_bridge_name(alias, function):
    by_alias = load_recipe(alias)
    assert load_recipe(function) == by_alias
    assert by_alias.hardware.gpu == "GB200" and by_alias.hardware.per_node == 4
    assert by_alias.provenance.function.endswith(function)
    assert by_alias.model.hf_id == "meta-models/Muse-Spark-Open-816B-A42B"


def test_function_names_appear_in_the_bridge_document(seeds):
    text = (seeds / "megatron-bridge-gb200-recipes.txt").read_text()
    for function in GB200.values():
        assert function in text


def test_stated_facts_of_the_bridge_recipes():
    sft = load_recipe("sft-192")
    assert (sft.layout.tp, sft.layout.pp, sft.layout.ep, sft.layout.dp) == (4, 6, 32, 8)
    assert sft.layout.pp_layers == [9, 11, 11, 11, 11, 9]
    assert (sft.batch.gbs, sft.batch.seq_length, sft.data.packs, sft.training.steps) == (128, 4096, 10951, 85)
    assert sft.data.split == "train[:100000]" and sft.data.revision.startswith("b14afda6")
    pre = load_recipe("pretrain-192")
    assert (pre.optimizer.lr, pre.optimizer.min_lr, pre.training.steps) == (3e-5, 3e-6, 100)
    assert "vision_tower" in pre.frozen
    long = load_recipe("sft-192-32k")
    assert (long.layout.cp, long.layout.cp_comm_type, long.batch.pack_alignment) == (2, "a2a", 8)
    coder = load_recipe("sft-192-coderforge-64k")
    assert (coder.layout.cp, coder.batch.pack_alignment, coder.batch.seq_length, coder.layout.dp) == (4, 16, 65536, 2)
    lora = load_recipe("lora-64")
    assert lora.peft.rank == 32 and lora.peft.alpha == 32 and lora.peft.per_expert
    assert lora.layout.pp_layers == [15, 16, 16, 15]
    mm = load_recipe("sft-192-mm")
    assert mm.frozen == ["audio_tower"] and mm.layout.distributed_optimizer is True


def test_unstated_values_are_null_with_a_note():
    for name in GB200:
        recipe = load_recipe(name)
        dumped = recipe.model_dump()
        for section in ("layout", "batch", "optimizer"):
            for key, value in dumped[section].items():
                if value is None and key in {"dp", "cp", "ep", "mbs", "gbs", "seq_length", "lr", "min_lr",
                                             "dispatcher", "distributed_optimizer", "sequence_parallel"}:
                    assert f"{section}.{key}" in recipe.notes, f"{name}: {section}.{key} is null without a note"


def test_proxies_override_only_what_differs():
    slice_cfg = load_recipe("slice-1gpu").model_config_resolved()
    assert slice_cfg.hidden_size == MUSE_SPARK_OPEN.hidden_size == 8192
    assert (slice_cfg.num_local_experts, slice_cfg.num_experts_per_tok, slice_cfg.num_hidden_layers) == (32, 8, 2)
    assert slice_cfg.resolved_layer_types == ["sliding_attention", "full_attention"]
    tiny = yaml.safe_load(open(load_recipe.__globals__["raw_recipe"]("tiny-cpu")[0]))
    for key, value in tiny["model"]["overrides"].items():
        assert getattr(MUSE_SPARK_OPEN, key) != value, f"tiny-cpu overrides {key} with the real value"


def test_real_model_active_parameters():
    assert MUSE_SPARK_OPEN.active_params == 44_432_883_712
    assert MUSE_SPARK_OPEN.active_params_per_layer == 689_963_008
    assert sum(t == "full_attention" for t in MUSE_SPARK_OPEN.resolved_layer_types) == 16


def test_model_config_round_trips_through_config_json(tmp_path):
    cfg = load_recipe("tiny-cpu").model_config_resolved()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": cfg.to_hf_text_config(), "vision_config": {}}))
    assert ModelConfig.from_hf_config(tmp_path) == cfg


def test_attune_recipe_is_the_record(seeds):
    imported = import_record(seeds / "openrecipes-b200-attune-record.txt", "attune-b200")
    assert imported == load_recipe("attune-b200")


def test_record_round_trip_preserves_every_field(seeds):
    record = read_record_file(seeds / "openrecipes-b200-attune-record.txt")
    back = recipe_to_record(load_recipe("attune-b200"))
    assert back == record
    assert list(back) == list(record)


def test_exported_record_with_results_reimports(tmp_path):
    recipe = load_recipe("attune-b200")
    results = {"tokens_per_s_per_gpu": 400.0, "usd_per_million_tokens": 9.9, "step_time_cv_percent": 2.0,
               "mfu_6n": 0.05, "active_params": 44432883712, "steps_completed": 20, "window": [5, 19],
               "gpu_hours": 10.0, "finished_at": "2026-11-30T10:00:00"}
    record = recipe_to_record(recipe, results=results)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(record, sort_keys=True))
    again = import_record(path, "mine")
    assert again.result.tokens_per_s_per_gpu == 400.0
    assert again.layout == recipe.layout


@pytest.mark.parametrize("text,field", [
    ("name: x\ntask: sft\nhardware: {gpu: H200, count: 1, per_node: 8}\ntraining: {steps: 1}\n", "provenance"),
    ("name: x\ntask: sft\nhardware: {gpu: Z100, count: 1, per_node: 8}\ntraining: {steps: 1}\n"
     "provenance: {source: me}\n", "hardware.gpu"),
    ("name: x\ntask: sft\nhardware: {gpu: H200, count: 1, per_node: 8}\ntraining: {steps: 1}\n"
     "provenance: {source: me}\nlayout: {tpp: 2}\n", "layout.tpp"),
    ("name: x\ntask: sft\nhardware: {gpu: H200, count: 0, per_node: 8}\ntraining: {steps: 1}\n"
     "provenance: {source: me}\n", "hardware.count"),
])
def test_malformed_recipe_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as exc:
        load_recipe(str(path))
    assert exc.value.field == field
    assert exc.value.fix


def test_bad_yaml_and_unknown_names(tmp_path, cli):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    rc, _, err = cli("show", path)
    assert rc == 2 and "not valid YAML" in err
    rc, _, err = cli("show", "sft-19")
    assert rc == 2 and "no such recipe" in err and "sft-192" in err


def test_overrides(cli):
    recipe = load_recipe("sft-192", ["layout.ep=16", "model.overrides.num_hidden_layers=4", "batch.gbs=64"])
    assert recipe.layout.ep == 16 and recipe.batch.gbs == 64
    assert recipe.model_config_resolved().num_hidden_layers == 4
    with pytest.raises(RecipeError) as exc:
        load_recipe("sft-192", ["layout.ep"])
    assert exc.value.field == "override"
    with pytest.raises(RecipeError) as exc:
        load_recipe("sft-192", ["layout.tp.x=1"])
    assert "is a value, not a section" in exc.value.message


def test_show_prints_resolved_yaml(cli):
    rc, out, _ = cli("show", "sft-192", "layout.ep=16")
    assert rc == 0
    data = yaml.safe_load(out)
    assert data["layout"]["ep"] == 16 and data["name"] == "sft-192"
    # the recipe as the run resolves it: on 32 nodes with no stated interval, the periodic save is filled by the
    # policy named in muse_stack/plan/save.py from the planned save and step time, and shown with its source
    from muse_stack.plan.planner import make_plan
    from muse_stack.plan.save import INTERVAL_POLICY, fill_interval

    expected = load_recipe("sft-192", ["layout.ep=16"])
    fill_interval(expected, make_plan(expected, strict=False)[0])
    assert expected.training.checkpoint_interval is not None
    assert out == recipe_yaml(expected) and f"fill policy {INTERVAL_POLICY}" in out


def test_list_json(cli):
    rc, out, _ = cli("list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rc == 0
    assert rows["sft-192"]["layout"] == "TP4/PP6/EP32" and rows["sft-192"]["gpus"] == 192


def test_list_marks_the_bridge_seeds_that_run_as_written_and_names_what_is_refused(cli):
    """Of the nine Megatron-Bridge GB200 seeds, those that state every size their engine starts from
    pass its check as written; the six whose sources leave batch sizes (or lora-16-mm's CP size)
    unstated are marked, as is a recipe the engine refuses outright (miles-h200-64 offloads the
    optimizer), each with its field and fix under the table (test_recipes_resolve.py)."""
    rc, out, _ = cli("list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    seeds = [r for r in rows.values() if r["source"].startswith("muse_spark_open_")]
    assert len(seeds) == 9 and {"sft-192-mm", "lora-16-mm"} <= {r["name"] for r in seeds}
    assert sorted(r["name"] for r in seeds if r["runs"] == "yes") == ["lora-64", "sft-192", "sft-256"]
    assert rows["miles-h200-64"]["runs"] == "no" and rows["miles-h200-64"]["refused"].startswith("offload.optimizer")
    rc, text, _ = cli("list")
    assert rc == 0 and "miles-h200-64 does not run as written: offload.optimizer" in " ".join(text.split())


def test_record_import_cli_refuses_to_overwrite(cli, seeds, tmp_path):
    out = tmp_path / "a.yaml"
    rc, _, _ = cli("record", "import", seeds / "openrecipes-b200-attune-record.txt", "--name", "a", "-o", out)
    assert rc == 0 and load_recipe(str(out)).layout.pp == 16
    before = out.read_text()
    rc, _, err = cli("record", "import", seeds / "openrecipes-b200-attune-record.txt", "--name", "a", "-o", out)
    assert rc != 0 and "exists" in err and out.read_text() == before


@pytest.mark.parametrize("override", [{"tie_word_embeddings": True}, {"attention_bias": True},
                                      {"num_shared_experts": 1}, {"num_key_value_heads": 3},
                                      {"num_experts_per_tok": 300}])
def test_model_config_refuses_what_muse_spark_is_not(override):
    with pytest.raises(ValueError):
        MUSE_SPARK_OPEN.with_overrides(**override)
