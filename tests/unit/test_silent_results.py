"""Results that were wrong without a word: a layout search that skipped the recipe's own layout,
a record round trip that changed the recipe, and outputs overwritten unasked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from muse_stack.plan import tune
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
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


# ---- 8. what trained otherwise than it said, or said otherwise than it trained -------------------
def test_a_warmup_stated_as_steps_and_as_a_fraction_is_refused_naming_both(cli):
    """tiny-cpu states warmup_steps 5; Bridge's scheduler.lr_warmup_fraction on top would have had no
    effect, without a word."""
    rc, _, err = cli("run", "tiny-cpu", "--dry-run", "scheduler.lr_warmup_fraction=0.1")
    said = " ".join(err.split())
    assert rc == 2 and "optimizer.warmup_fraction" in said and "optimizer.warmup_steps" in said, err
    rc, _, err = cli("run", "tiny-cpu", "--dry-run", "scheduler.lr_warmup_fraction=0.1", "optimizer.warmup_steps=null")
    assert rc == 0, err


@pytest.mark.parametrize("override, field", [
    ("model.overrides.eos_token_id=512", "model.overrides.eos_token_id"),  # tiny-cpu's vocabulary is 0..511
    ("model.overrides.eos_token_id=[2,600]", "model.overrides.eos_token_id"),
    ("model.overrides.pad_token_id=9999", "model.overrides.pad_token_id"),
    ("model.overrides.bos_token_id=-1", "model.overrides.bos_token_id"),
])
def test_a_special_token_id_outside_the_vocabulary_is_refused(cli, override, field):
    rc, _, err = cli("run", "tiny-cpu", "--dry-run", override)
    said = " ".join(err.split())
    assert rc == 2 and field in said and "vocab_size" in said, err


def test_the_last_id_of_the_vocabulary_is_a_valid_eos(cli):
    rc, _, err = cli("run", "tiny-cpu", "--dry-run", "model.overrides.eos_token_id=511")
    assert rc == 0, err


def test_tune_of_a_cpu_recipe_says_that_no_step_time_can_be_predicted(cli):
    """tiny-cpu fits every layout it could plan; what tune lacks is the GPU figures of `cpu` (and the
    reference engine's step-time model), not memory or a rule."""
    rc, out, err = cli("tune", "tiny-cpu", "--no-progress")
    said = " ".join((out + err).split())
    assert rc == 2 and "hardware.gpu" in said and "no GPU figures for cpu" in said and "--gpu" in said, said
    assert "fits" not in said and "memory" not in said
    rc, out, err = cli("tune", "tiny-cpu", "--no-progress", "--gpu", "H100")
    said = " ".join((out + err).split())
    assert rc == 2 and "engine" in said and "engine=megatron" in said, said


def _losses(path):
    import json

    return [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_diff_of_runs_that_train_bitwise_alike_is_not_numerics(cli, tmp_path, monkeypatch, one_thread, capsys):
    """The docs' example (a stated lr 5e-6 against the fill policy's 5e-6) and a change of
    keep_checkpoints only: the runs' losses are equal bit for bit, and diff says so, rather than
    "numerics differ" for the whole recipe's hash."""
    from muse_stack.run.pipeline import run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    common = [*QUICK, "optimizer.min_lr=0"]
    filled = run("tiny-cpu", out=tmp_path / "filled", steps=2, progress=False, overrides=[*common, "optimizer.lr=null"])
    stated = run("tiny-cpu", out=tmp_path / "stated", steps=2, progress=False, overrides=[*common, "optimizer.lr=5e-6"])
    kept = run("tiny-cpu", out=tmp_path / "kept", steps=2, progress=False,
               overrides=[*common, "optimizer.lr=null", "training.keep_checkpoints=3"])
    assert filled.status == stated.status == kept.status == "completed"
    assert _losses(filled.path) == _losses(stated.path) == _losses(kept.path)
    capsys.readouterr()  # the runs' step lines
    rc, out, _ = cli("diff", filled.path, stated.path, "--json")
    report = json.loads(out)
    assert rc == 0 and report["counts"]["numerics"] == 0, report
    assert {d["path"] for d in report["differences"]} == {"recipe.filled", "run_inputs.recipe_sha256"}
    rc, out, _ = cli("diff", filled.path, kept.path, "--json")
    report = json.loads(out)
    assert rc == 1 and report["counts"]["numerics"] == 0, report
    hashes = [d for d in report["differences"] if d["path"] == "run_inputs.recipe_sha256"]
    assert len(hashes) == 1 and hashes[0]["class"] == "performance"  # as training.keep_checkpoints is
    # a field that changes the numbers still makes the hash numerics
    other = run("tiny-cpu", out=tmp_path / "other", steps=2, progress=False, overrides=[*common, "optimizer.lr=1e-5"])
    capsys.readouterr()
    rc, out, _ = cli("diff", filled.path, other.path, "--json")
    report = json.loads(out)
    assert rc == 2 and {d["class"] for d in report["differences"] if d["path"] == "run_inputs.recipe_sha256"} == {
        "numerics"}


def test_resume_with_a_recipe_other_than_the_runs_is_refused(cli, tmp_path, one_thread, monkeypatch):
    """`run RECIPE --resume DIR` compares RECIPE with the run's own recipe (as --resume auto does): a
    different one is refused naming the field; the run's own continues; nothing is ignored silently."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--steps", "3", "--stop-after", "1", "--no-progress", *QUICK)
    assert rc == 1, err
    other = tmp_path / "other.yaml"
    other.write_text((ROOT / "recipes" / "tiny-cpu.yaml").read_text().replace("  lr: 1.0e-2\n", "  lr: 2.0e-2\n"))
    assert other.read_text() != (ROOT / "recipes" / "tiny-cpu.yaml").read_text()
    before = (out / "metrics.jsonl").read_bytes()
    rc, _, err = cli("run", other, "--resume", out, "--steps", "3", "--no-progress", *QUICK)
    said = " ".join(err.split())
    assert rc == 3 and "optimizer.lr: 0.01 -> 0.02" in said and "RECIPE" in said, err
    assert (out / "metrics.jsonl").read_bytes() == before
    rc, _, err = cli("run", "tiny-cpu", "--resume", out, "--steps", "3", "--no-progress", *QUICK)
    assert rc == 0, err
    assert json.loads((out / "results.json").read_text())["resumed_at_step"] == 1


def test_a_runs_record_imports_to_the_recipe_the_run_resolved_and_trains_alike(cli, tmp_path, monkeypatch,
                                                                              one_thread):
    """record export then record import: every field that the run computes with (data, seeds, batch,
    layout, training, ...) comes back; what differs is its name, description, notes and recorded
    results, and the rows' hash, which the import pins to the rows the run trained on; the imported
    recipe's run gives the same losses bit for bit."""
    from muse_stack.compare.classify import INFORMATIONAL, classify
    from muse_stack.run.pipeline import prepare, run
    from muse_stack.run.resume import changed_fields
    from muse_stack.run.rundir import read_run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    done = run("tiny-cpu", out=tmp_path / "run", steps=2, progress=False, overrides=QUICK)
    assert done.status == "completed"
    _round_trip(cli, tmp_path, tmp_path / "run")
    original = read_run(tmp_path / "run").recipe
    imported = prepare(str(tmp_path / "back.yaml"), [], None, None).recipe
    differ = {k: classify(f"recipe.{k}") for k in changed_fields(original, imported)}
    rows = json.loads((tmp_path / "run" / "fingerprint.json").read_text())["run_inputs"]["rows_sha256"]
    assert original.data.rows_sha256 is None and imported.data.rows_sha256 == rows
    del differ["data.rows_sha256"]
    assert differ and set(differ.values()) == {INFORMATIONAL}, differ
    again = run(str(tmp_path / "back.yaml"), out=tmp_path / "again", progress=False)
    assert again.status == "completed" and _losses(again.path) == _losses(done.path)


def _kubernetes_expand(value: str, env: dict[str, str]) -> str:
    """What Kubernetes makes of an env value (k8s.io/kubernetes third_party/forked/golang/expansion):
    ``$$`` is one ``$``, ``$(NAME)`` a variable defined before it (else kept as written), any other
    ``$`` itself."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "$" and i + 1 < len(value):
            if value[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            end = value.find(")", i + 2) if value[i + 1] == "(" else -1
            if end != -1:
                name = value[i + 2:end]
                out.append(env.get(name, value[i:end + 1]))
                i = end + 1
                continue
        out.append(value[i])
        i += 1
    return "".join(out)


@pytest.mark.parametrize("value, meant", [
    ("$(MUSE_STACK_RUN_DIR)", "$(MUSE_STACK_RUN_DIR)"),  # a literal, as the sbatch writes it
    ("--flag=$(MUSE_STACK_IMAGE)x", "--flag=$(MUSE_STACK_IMAGE)x"),
    ("a$$b", "a$" + "<b>"),  # a literal $ then the reference $b
    ("price $5 and $", "price $5 and $"),
    ("$MUSE_STACK_RUN_DIR/logs", "<MUSE_STACK_RUN_DIR>/logs"),  # shell-style references stay references
    ("${MUSE_STACK_IMAGE}", "<MUSE_STACK_IMAGE>"),
])
def test_a_k8s_env_value_reaches_the_container_as_the_sbatch_would_give_it(value, meant):
    import dataclasses

    from muse_stack.launch import k8s
    from muse_stack.launch.spec import resolve

    spec = resolve("proxy-8gpu", image="registry.example.com/muse-stack:h200-0.1.0")
    spec = dataclasses.replace(spec, env={"MY_VALUE": value})
    docs = list(yaml.safe_load_all(k8s.render(spec, claim="c")))
    env = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    defined = {e["name"]: f"<{e['name']}>" for e in env} | {"b": "<b>"}
    mine = next(e["value"] for e in env if e["name"] == "MY_VALUE")
    assert _kubernetes_expand(mine, defined) == meant
