"""Results that were wrong without a word: a layout search that skipped the recipe's own layout,
a record round trip that changed the recipe, and outputs overwritten unasked."""

from __future__ import annotations

import math

import yaml

from muse_stack.plan import tune
from muse_stack.recipes.catalogue import load_recipe

QUICK = ["training.measure_warmup_steps=1", "batch.gbs=2"]


# ---- 5. tune searches every size the rules accept ----------------------------------------------
def test_tune_tries_the_recipes_own_tp4_pp6_layout():
    """sft-192 runs TP4/PP6 (9+4x11+9) EP32 on 192 GPUs, which `plan` accepts; a search over
    powers of two alone leaves no data-parallel size that GBS 128 splits over (192 = 3 x 64)."""
    recipe = load_recipe("sft-192")
    seen = {(c.layout["tp"], c.layout["pp"], c.layout["ep"], c.layout["first_stage_layers"],
             c.layout["last_stage_layers"], c.mbs, c.granularity) for c in tune.candidates(recipe, 192)}
    assert (4, 6, 32, 9, 9, 1, "full") in seen


def test_tune_sizes_are_every_divisor_the_rules_accept():
    recipe = load_recipe("sft-192")
    model = recipe.model_config_resolved()
    cands = list(tune.candidates(recipe, 192))
    heads = math.gcd(model.num_attention_heads, model.num_key_value_heads)
    assert {c.layout["tp"] for c in cands} == {d for d in range(1, recipe.hardware.per_node + 1) if heads % d == 0}
    # 192 GPUs = 3 x 64 and GBS 128: DP must be a power of two, so the factor 3 goes to PP (TP and CP
    # divide the 16 KV heads); of PP 3, 6, 12, 24 and 48, 62 layers split at 3 (20+1x22+20...),
    # 6 (9+4x11+9, the recipe's) and 12; powers of two alone gave none
    assert {c.layout["pp"] for c in cands} == {3, 6, 12}
    assert {c.layout["ep"] for c in cands} == {1, 2, 4, 8, 16, 32, 64}  # dividing the 256 experts and 192 / PP
    assert {c.layout["cp"] for c in cands} == {1, 2, 4, 8, 16}  # dividing the KV heads per TP rank


def test_tune_sft_192_finds_layouts_and_says_what_it_did_not_search(cli):
    rc, out, err = cli("tune", "sft-192", "--no-progress", "--top", "3")
    text = " ".join((out + err).split())
    assert rc == 0, text
    assert "the recipe's own layout:" in text and "no layout" not in text
    assert "not searched: TP above the 4 GPUs of a node" in text and "micro-batch sizes above 2" in text


# ---- 6. the OpenRecipes record round trip --------------------------------------------------------
def _round_trip(cli, tmp_path, run_dir):
    record, back = tmp_path / "record.yaml", tmp_path / "back.yaml"
    rc, _, err = cli("record", "export", run_dir, "-o", record)
    assert rc == 0, err
    rc, _, err = cli("record", "import", record, "--name", "back", "-o", back)
    assert rc == 0, err
    return yaml.safe_load(record.read_text()), load_recipe(str(back))


def test_a_runs_record_imports_back_to_the_same_engine_task_model_and_optimizer(cli, tmp_path, monkeypatch,
                                                                                one_thread):
    from muse_stack.run.pipeline import run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    done = run("tiny-cpu", out=tmp_path / "run", steps=2, progress=False, overrides=QUICK)
    assert done.status == "completed"
    before = load_recipe(str(tmp_path / "run" / "recipe.yaml"))
    record, after = _round_trip(cli, tmp_path, tmp_path / "run")
    assert record["run"].startswith("muse-stack run tiny-cpu engine=reference task=sft")
    assert (after.engine, after.task) == (before.engine, before.task) == ("reference", "sft")
    assert after.model_config_resolved() == before.model_config_resolved()
    assert after.model_config_resolved().hidden_size == 64
    assert after.optimizer == before.optimizer and after.optimizer.name == "adamw"
    # the notes say what is true of this record: its window, its offload, where the optimizer came from
    window = record["result"]["window"]
    assert after.notes["training.measure_warmup_steps"] == \
        f"the record's window starts at step {window[0]} of {record['result']['steps_per_run']}"
    assert after.notes["offload"] == "the record's layout.offload is null"
    assert after.notes["optimizer"] == "read from the record's run command"


def test_an_adapter_recipes_record_keeps_its_adapters(tmp_path):
    from muse_stack.recipes.openrecipes import import_record, recipe_to_record, record_yaml

    recipe = load_recipe("tiny-cpu", ["peft.scheme=dora", "peft.rank=4", "peft.alpha=8", "peft.dropout=0.1",
                                      "peft.per_expert=false", "peft.targets=[self_attn.q_proj]", "optimizer.name=sgd"])
    path = tmp_path / "r.yaml"
    path.write_text(record_yaml(recipe_to_record(recipe, results={"steps_completed": 3, "window": None,
                                                                  "finished_at": "2026-12-02T10:00:00"})))
    back = import_record(path, "back")
    assert back.peft == recipe.peft and back.optimizer == recipe.optimizer and back.engine == recipe.engine
    assert "training.measure_warmup_steps" not in back.notes  # no window recorded: no note about one


def test_a_published_record_keeps_its_notes(seeds):
    from muse_stack.recipes.openrecipes import import_record

    notes = import_record(seeds / "openrecipes-b200-attune-record.txt", "attune-b200").notes
    assert notes["training.measure_warmup_steps"] == "the record's window starts at step 5 of 20"
    assert notes["offload"] == "the record's layout.offload is null and its summary says no offload"


# ---- 7. outputs are not overwritten unasked ------------------------------------------------------
def test_tune_out_refuses_an_existing_file_unless_forced(cli, tmp_path):
    out = tmp_path / "best.txt"
    out.write_text("mine\n")
    rc, _, err = cli("tune", "attune-b200", "--no-progress", "--out", out)
    said = " ".join(err.split())
    assert rc == 3 and "--out" in said and "--force" in said and "another path" in said
    assert out.read_text() == "mine\n"
    rc, _, err = cli("tune", "attune-b200", "--no-progress", "--top", "1", "--out", out, "--force")
    assert rc == 0, err
    assert out.read_text().startswith("layout.tp=")


def test_data_build_out_refuses_existing_files_unless_forced(cli, tmp_path):
    out = tmp_path / "rows"
    out.mkdir()
    (out / "build.json").write_text("{}\n")
    cache = tmp_path / "cache"
    rc, _, err = cli("data", "build", "tiny-cpu", "--out", out, "--cache", cache, "--json")
    said = " ".join(err.split())
    assert rc == 3 and "--out" in said and "--force" in said and "build.json" in said
    assert (out / "build.json").read_text() == "{}\n" and not cache.exists()  # refused before building
    rc, _, err = cli("data", "build", "tiny-cpu", "--out", out, "--cache", cache, "--json", "--force")
    assert rc == 0, err
    assert (out / "rows.parquet").is_file() and (out / "build.json").read_text() != "{}\n"


def test_data_build_into_a_fresh_folder_needs_no_flag(cli, tmp_path):
    rc, _, err = cli("data", "build", "tiny-cpu", "--out", tmp_path / "new", "--cache", tmp_path / "cache", "--json")
    assert rc == 0, err
    assert (tmp_path / "new" / "rows.parquet").is_file()
