"""Bad input gets the project's own error: a message naming the field and the fix, exit 2 for a
wrong request and 3 for a missing or corrupt input file; never a traceback, a hang, a silent wrong
result, a leaked secret or a file written with the wrong mode."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from muse_stack.util import atomic
from muse_stack.util.errors import INTERNAL_ERROR, InputError, MuseStackError, RecipeError
from muse_stack.util.safeio import load_yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-cpu.yaml"
FIX = "fix:"


def refused(result, code: int, *needles: str) -> str:
    rc, out, err = result
    assert rc == code, (rc, out, err)
    assert "Traceback" not in err and "internal error" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ---- recipe files: binary, Latin-1, a directory, YAML bombs and duplicate keys -----------------
def test_unreadable_recipe_files_exit_3(cli, tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x00\x01\xff\xfe" * 100)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(TINY.read_text().replace("description:", "description: caf\xe9").encode("latin-1"))
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    for path, needle in ((binary, "not UTF-8"), (latin, "not UTF-8"), (directory, "is a directory"),
                         (tmp_path, "is a directory")):
        for cmd in ("show", "plan"):
            refused(cli(cmd, path), 3, needle, FIX)
        refused(cli("record", "import", path, "--name", "x"), 3, needle, FIX)


def test_billion_laughs_is_refused_at_once(cli, tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(TINY.read_text() + "correctness:\n" + "\n".join("  " + line for line in lines) + "\n")
    refused(cli("show", bomb), 2, "expands to more than", FIX)
    refused(cli("plan", "tiny-cpu", "correctness.x=" + "{" + ", ".join(lines).replace(": &", ": &") + "}"), 2)
    with pytest.raises(RecipeError, match="refers to itself"):
        load_yaml("a: &x [*x]", source="t", field="t")


def test_duplicate_keys_are_refused(cli, tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text(TINY.read_text() + "name: other\n")
    refused(cli("show", dup), 2, "duplicate key 'name'", FIX)
    # keys merged in with << may be overridden: that is YAML's merge, not a duplicate
    assert load_yaml("base: &b {x: 1}\nd:\n  <<: *b\n  x: 2\n", source="t", field="t")["d"] == {"x": 2}


def test_error_messages_never_repr_an_unbounded_value():
    exc = MuseStackError("too big", field="x", value=["y" * 1000] * 10_000)
    assert len(exc.render()) < 1000
    assert len(json.dumps(exc.as_dict())) < 3000


# ---- schema bounds ------------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("optimizer.lr=.inf", "optimizer.lr"), ("optimizer.lr=.nan", "optimizer.lr"), ("optimizer.lr=0", "optimizer.lr"),
    ("optimizer.lr=-1", "optimizer.lr"), ("optimizer.beta2=1.5", "optimizer.beta2"), ("optimizer.eps=0", "optimizer.eps"),
    ("hardware.count=1000000000000", "hardware.count"), ("layout.tp=0", "layout.tp"),
    ("batch.seq_length=100000000000", "batch.seq_length"), ("training.steps=99999999999999", "training.steps"),
    ("model.overrides.hidden_size=-1", "model.overrides.hidden_size"),
    ("model.overrides.num_local_experts=0", "model.overrides.num_local_experts"),
    ("model.overrides.num_hidden_layers=1000000000000", "model.overrides.num_hidden_layers"),
    ("model.overrides.nonsense=1", "model.overrides.nonsense"), ("model.overrides.head_dim=15", "model.overrides"),
    ("name=../../x", "name"), ("name=a/b", "name"), ("data.build_name=../up", "data.build_name"),
    ("layout..tp=2", "override"), (".layout.tp=2", "override"), ("env.A-B=1", "env"),
])
def test_schema_refuses_out_of_bounds_values(cli, override, field):
    err = refused(cli("plan", "tiny-cpu", override), 2, FIX)
    assert f"{field} = " in err or field in err.splitlines()[0]


def test_plan_gpus_must_be_positive_and_bounded(cli):
    refused(cli("plan", "sft-192", "--gpus", "0"), 2, "--gpus = 0", FIX)
    refused(cli("plan", "sft-192", "--gpus", "1000000000000"), 2, "--gpus", FIX)
    refused(cli("launch", "tiny-cpu", "--slurm", "--gpus", "0"), 2, "--gpus", FIX)
    refused(cli("launch", "sft-192", "--slurm", "--gpus", "1000000000000"), 2, "--gpus = 1000000000000", FIX)
    refused(cli("launch", "sft-192", "--slurm", "--nodes", "1000000000000"), 2, "--nodes", FIX)
    refused(cli("run", "tiny-cpu", "--gpus", "0"), 2, "--gpus = 0", FIX)


def test_sequence_rule_is_checked_whatever_cp_is(cli):
    err = refused(cli("plan", "sft-192", "batch.seq_length=4095", "layout.sequence_parallel=true"), 2,
                  "batch.seq_length = 4095", FIX)
    assert "= 4 " in err  # TP 4 x CP 1 with sequence parallelism
    refused(cli("plan", "sft-192-32k", "batch.seq_length=32764"), 2, "batch.seq_length")


# ---- data: JSONL, tokenizer config, the cache ---------------------------------------------------
def _tiny_data(tmp_path: Path, jsonl: str | None = None, config: str | None = None) -> list[str]:
    files = str(ROOT / "data" / "tiny-chat.jsonl")
    tok = str(ROOT / "data" / "tiny-tokenizer")
    if jsonl is not None:
        (tmp_path / "chat.jsonl").write_text(jsonl)
        files = str(tmp_path / "chat.jsonl")
    if config is not None:
        shutil.copytree(tok, tmp_path / "tok")
        (tmp_path / "tok" / "tokenizer_config.json").write_text(config)
        tok = str(tmp_path / "tok")
    return [f"data.files=[{files}]", f"data.tokenizer={tok}"]


@pytest.mark.parametrize("jsonl, needle", [('[1, 2, 3]\n', "JSON list, not a dict"), ('{"messages": [\n', "not valid JSON"),
                                           ("[" * 100_000 + "\n", "not valid JSON")])
def test_bad_jsonl_lines_exit_3(cli, tmp_path, jsonl, needle):
    refused(cli("data", "build", "tiny-cpu", *_tiny_data(tmp_path, jsonl=jsonl), "--cache", tmp_path / "c", "--json"),
            3, "data.files", needle, FIX)


def test_binary_jsonl_exits_3(cli, tmp_path):
    args = _tiny_data(tmp_path, jsonl="")
    (tmp_path / "chat.jsonl").write_bytes(b'{"messages": []}\n\xff\xfe\x00\n')
    refused(cli("data", "build", "tiny-cpu", *args, "--cache", tmp_path / "c", "--json"), 3, "chat.jsonl:2",
            "not UTF-8", FIX)


@pytest.mark.parametrize("config", ["{not json", "[1, 2]", '{"eos_token": 7}'])
def test_malformed_tokenizer_config_exits_3(cli, tmp_path, config):
    refused(cli("data", "build", "tiny-cpu", *_tiny_data(tmp_path, config=config), "--cache", tmp_path / "c", "--json"),
            3, "tokenizer_config.json", FIX)


def test_cached_build_is_verified_and_rebuilt(cli, tmp_path, capsys):
    from muse_stack.data.build import build_for_recipe
    from muse_stack.recipes.catalogue import load_recipe

    cache = tmp_path / "cache"
    recipe = load_recipe("tiny-cpu")
    first = build_for_recipe(recipe, cache_dir=cache, progress=False)
    good = first.parquet.read_bytes()
    # a swapped rows.parquet (another seed's rows): rebuilt, and the rows hash is the true one again
    other = build_for_recipe(load_recipe("tiny-cpu", ["data.seed=7"]), cache_dir=tmp_path / "other", progress=False)
    assert other.rows_sha256 != first.rows_sha256
    first.parquet.write_bytes(other.parquet.read_bytes())
    capsys.readouterr()
    again = build_for_recipe(recipe, cache_dir=cache, progress=False)
    assert "does not match its record" in capsys.readouterr().err
    assert again.rows_sha256 == first.rows_sha256 and again.parquet.read_bytes() == good
    from muse_stack.data.rows import rows_sha256

    assert rows_sha256(again.rows()) == first.rows_sha256
    # a truncated one: the same
    again.parquet.write_bytes(good[: len(good) // 2])
    third = build_for_recipe(recipe, cache_dir=cache, progress=False)
    assert third.parquet.read_bytes() == good and rows_sha256(third.rows()) == first.rows_sha256
    # an intact cache is used as it is (nothing rebuilt, no warning)
    capsys.readouterr()
    build_for_recipe(recipe, cache_dir=cache, progress=False)
    assert "does not match" not in capsys.readouterr().err


# ---- outputs: paths that cannot be written, file modes ------------------------------------------
def test_output_under_a_file_parent_exits_3(cli, tmp_path):
    parent = tmp_path / "a-file"
    parent.write_text("x")
    refused(cli("run", "tiny-cpu", "--steps", "1", "--out", parent / "run"), 3, "--out", FIX)
    refused(cli("launch", "tiny-cpu", "--slurm", "-o", parent / "job.sbatch"), 3, "--output", FIX)
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.recipes.openrecipes import recipe_to_record, record_yaml

    record = tmp_path / "record.yaml"
    record.write_text(record_yaml(recipe_to_record(load_recipe("attune-b200"))))
    refused(cli("record", "import", record, "--name", "x", "-o", parent / "x.yaml"), 3, "--out", FIX)
    refused(cli("data", "build", "tiny-cpu", "--cache", parent / "cache", "--json"), 3, "--cache", FIX)
    refused(cli("fingerprint", "-o", parent / "fp.json"), 3, "--output", FIX)
    assert parent.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_under_a_read_only_parent_exits_3(cli, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        refused(cli("run", "tiny-cpu", "--steps", "1", "--out", ro / "run"), 3, "--out", FIX)
        refused(cli("launch", "tiny-cpu", "--slurm", "-o", ro / "job.sbatch"), 3, "--output", FIX)
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = atomic.write_json(tmp_path / "x" / "results.json", {"a": 1})
        atomic.append_line(tmp_path / "x" / "metrics.jsonl", "{}")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
    assert (tmp_path / "x" / "metrics.jsonl").stat().st_mode & 0o777 == mode


# ---- runs: resume from truncated state, export of unfinished runs --------------------------------
@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    from muse_stack.run.pipeline import run

    out = tmp_path_factory.mktemp("runs") / "part"
    outcome = run("tiny-cpu", out=out, steps=4, stop_after=2, progress=False)
    assert outcome.status == "interrupted"
    assert (out / "recipe.yaml").stat().st_mode & 0o777 == 0o666 & ~_umask()
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("damage, needle", [
    (lambda c: (c / "optimizer.pt").write_bytes((c / "optimizer.pt").read_bytes()[:100]), "optimizer"),
    (lambda c: (c / "optimizer.pt").write_bytes(b""), "optimizer"),
    (lambda c: (c / "trainer_state.json").write_text('{"st'), "trainer_state.json"),
    (lambda c: (c / "trainer_state.json").write_text('{"step": 1000000000000}'), "not a step of this run"),
    (lambda c: (c / "trainer_state.json").write_text('[2]'), "trainer_state.json"),
])
def test_truncated_checkpoint_state_exits_3(cli, tmp_path, interrupted, damage, needle):
    run_dir = tmp_path / "part"
    shutil.copytree(interrupted, run_dir)
    pointer = json.loads((run_dir / "checkpoints" / "latest").read_text())
    damage(run_dir / "checkpoints" / pointer["folder"])
    refused(cli("run", "--resume", run_dir, "--no-progress"), 3, "--resume", needle, FIX)


def test_record_export_refuses_an_unfinished_run(cli, interrupted, tmp_path):
    refused(cli("record", "export", interrupted), 2, "only a finished run", FIX)
    refused(cli("record", "export", tmp_path), 3, "not a run directory")


# ---- diff of a structurally corrupt fingerprint --------------------------------------------------
@pytest.mark.parametrize("damage, needle", [
    (lambda d: d.pop("frameworks"), "no frameworks section"),
    (lambda d: d.update(gpu="broken"), "gpu section must be a JSON object"),
    (lambda d: d.update(kind="something-else"), "kind"),
])
def test_diff_of_a_corrupt_fingerprint_exits_3(cli, tmp_path, damage, needle):
    good = ROOT / "tests" / "fixtures" / "fingerprints" / "cpu-debian12-torch2.13.json"
    doc = json.loads(good.read_text())
    damage(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    refused(cli("diff", good, bad), 3, needle, FIX)


# ---- secrets ---------------------------------------------------------------------------------
SECRET = "s3cr3t-t0ken-value-1234"


@pytest.mark.parametrize("override, field", [
    (f"env.WANDB_API_KEY={SECRET}", "env.WANDB_API_KEY"),
    (f"data.template_kwargs.api_key={SECRET}", "data.template_kwargs.api_key"),
    (f"data.details.hfToken={SECRET}", "data.details.hfToken"),
    (f"data.files=[https://user:{SECRET}@example.com/x.jsonl]", "data.files[0]"),
    (f"data.dataset=https://{SECRET}@example.com/ds", "data.dataset"),
])
def test_secret_values_are_refused_and_never_echoed(cli, tmp_path, override, field):
    for args in (["show", "tiny-cpu", override], ["run", "tiny-cpu", override, "--out", tmp_path / "r"],
                 ["launch", "tiny-cpu", "--slurm", override]):
        rc, out, err = cli(*args)
        assert rc == 2 and f"{field} = '<redacted>'" in err and "${env:" in err, err
        assert SECRET not in out + err
    assert not (tmp_path / "r").exists()


def test_env_references_are_accepted_and_not_resolved_into_files(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TEMPLATE_KEY", SECRET)
    rc, out, err = cli("show", "tiny-cpu", "env.WANDB_API_KEY=${env:WANDB_API_KEY}",
                       "data.template_kwargs.api_key=${env:MY_TEMPLATE_KEY}")
    assert rc == 0, err
    shown = yaml.safe_load(out)
    assert shown["env"]["WANDB_API_KEY"] == "${env:WANDB_API_KEY}"
    from muse_stack.data.chat import ChatTokenizer

    tok = ChatTokenizer(ROOT / "data" / "tiny-tokenizer", {"api_key": "${env:MY_TEMPLATE_KEY}"})
    assert tok._resolved_kwargs == {"api_key": SECRET}  # read from the environment when rendering
    assert SECRET not in json.dumps(tok.describe())  # what build.json records: the reference
    monkeypatch.delenv("MY_TEMPLATE_KEY")
    with pytest.raises(InputError, match="MY_TEMPLATE_KEY"):
        ChatTokenizer(ROOT / "data" / "tiny-tokenizer", {"api_key": "${env:MY_TEMPLATE_KEY}"})._resolved_kwargs


def test_url_credentials_are_redacted_wherever_written(tmp_path):
    url = f"https://user:{SECRET}@example.com/data.jsonl"
    atomic.write_json(tmp_path / "results.json", {"source": url})
    atomic.append_line(tmp_path / "metrics.jsonl", json.dumps({"source": url}))
    for name in ("results.json", "metrics.jsonl"):
        text = (tmp_path / name).read_text()
        assert SECRET not in text and "https://<redacted>@example.com/data.jsonl" in text
    assert SECRET not in InputError("cannot read", field="data.files", value=url, fix="x").render()


# ---- defects are reported without a traceback ------------------------------------------------------
def test_a_defect_exits_70_without_a_traceback(cli, monkeypatch):
    import muse_stack.cli.recipes as commands

    def boom(*_a, **_k):
        raise ZeroDivisionError("x" * 10_000)

    monkeypatch.setattr(commands, "load_recipe", boom)
    rc, _, err = cli("show", "tiny-cpu")
    assert rc == INTERNAL_ERROR and "Traceback" not in err and "MUSE_STACK_DEBUG" in err and len(err) < 2000
