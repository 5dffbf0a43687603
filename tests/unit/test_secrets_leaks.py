"""Each way a secret reached a file or a stream: a URL credential in --pretrained-checkpoint,
secrets under names a word list missed (pwd, bearer, DB_PASS, GITHUB_PAT, notes.*, ?token=), a
malformed secret override echoed on stderr; and the shape rule of muse_stack/util/credentials.py."""

from __future__ import annotations

import ast
import random
import string
from pathlib import Path

import pytest

from muse_stack.fingerprint import environment
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.util import credentials
from muse_stack.util.errors import InputError, RecipeError

ROOT = Path(__file__).resolve().parents[2]
PW = "Xk9-pw-4417-zz"  # not shaped like a token: only its key or its place in a URL says it is secret
TOKEN = "ghp_" + "4fQ7zR1mK8pL2sT9vW3xY6bN0cD5eG7hJ1kM"


def _refused(cli, args, secret, tmp_path, field=None):
    rc, out, err = cli(*args)
    assert rc == 2, (rc, out, err)
    assert secret not in out + err, err
    assert "${env:" in err and "Traceback" not in err, err
    if field is not None:
        assert f"{field} = '<redacted>'" in err, err
    assert not (tmp_path / "r").exists()
    return err


def test_a_url_credential_in_pretrained_checkpoint_is_refused(cli, tmp_path):
    url = f"https://user:{PW}@example.com/ckpt"
    _refused(cli, ["run", "tiny-cpu", "--steps", "1", "--pretrained-checkpoint", url, "--out", tmp_path / "r"],
             PW, tmp_path, "--pretrained-checkpoint")
    # what path normalisation makes of it (// -> /) is a URL credential too
    _refused(cli, ["run", "tiny-cpu", "--steps", "1", "--pretrained-checkpoint", str(Path(url)), "--out",
                   tmp_path / "r"], PW, tmp_path, "--pretrained-checkpoint")


@pytest.mark.parametrize("override, field", [
    (f"env.pwd={PW}", "env.pwd"),
    (f"env.DB_PASS={PW}", "env.DB_PASS"),
    (f"env.GITHUB_PAT={PW}", "env.GITHUB_PAT"),
    (f"data.details.bearer={PW}", "data.details.bearer"),
    (f"data.template_kwargs.pwd={PW}", "data.template_kwargs.pwd"),
    (f"notes.deploy={TOKEN}", "notes.deploy"),
    (f"notes.how=use Bearer {PW}", "notes.how"),
    (f"data.dataset=https://example.com/ds?token={PW}", "data.dataset"),
    (f"provenance.url=https://example.com/x?a=1&X-Amz-Signature={PW}", "provenance.url"),
    (f"description=see user:{PW}@registry.example.com/img", "description"),
])
def test_secrets_under_any_name_are_refused_and_never_echoed(cli, tmp_path, override, field):
    for args in (["show", "tiny-cpu", override], ["run", "tiny-cpu", override, "--out", tmp_path / "r"],
                 ["launch", "tiny-cpu", "--slurm", override, "-o", tmp_path / "job.sbatch"]):
        _refused(cli, args, PW if PW in override else TOKEN, tmp_path, field)
        assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("override", [
    f"env.DB_PASS=[{PW}", f"data.details.api_key={{{PW}", f"notes.x=[{TOKEN}", f"data.details.x=\"{TOKEN}",
    f"env.GITHUB_PAT=!!binary {PW}", TOKEN, f"notes.{TOKEN}=1",
])
def test_a_malformed_secret_override_is_not_echoed(cli, tmp_path, override):
    secret = PW if PW in override else TOKEN
    for args in (["show", "tiny-cpu", override], ["plan", "tiny-cpu", override]):
        rc, out, err = cli(*args)
        assert rc == 2 and secret not in out + err and "Traceback" not in err, (rc, err)


def test_references_are_accepted_under_secret_names(cli):
    rc, out, err = cli("show", "tiny-cpu", "env.DB_PASS=${env:DB_PASS}", "env.GITHUB_PAT=$GITHUB_PAT",
                       "data.template_kwargs.pwd=${env:MY_PWD}", "data.dataset=https://example.com/ds?token=${env:T}")
    assert rc == 0, err


def test_errors_and_written_text_redact_every_unambiguous_shape(tmp_path):
    from muse_stack.util import atomic

    texts = {f"https:/user:{PW}@host/x": PW, f"user:{PW}@registry.example.com/img": PW,
             f"https://h/x?token={PW}": PW, f"Authorization: Bearer {PW}": PW, f"key {TOKEN} end": TOKEN,
             "hf_" + "aB3dE5gH7jK9mN1pQ3rS5t": "hf_" + "aB3dE5gH7jK9mN1pQ3rS5t"}
    for text, secret in texts.items():
        assert secret not in InputError("cannot read", field="x", value=text, fix="x").render()
        assert secret not in InputError(f"cannot read {text}", field="x", value=1).render()
        atomic.write_text(tmp_path / "f.txt", text)
        assert secret not in (tmp_path / "f.txt").read_text()
    # an image digest and a plain URL are left as they are
    for keep in ("registry.example.com/muse:gb200@sha256:" + "ab" * 32, "https://example.com/a?revision=main",
                 "FROM nvidia/cuda:13.0.0-devel-ubuntu24.04@sha256:1e8ac7a5...", "query words (`?token=`, `&sig=`)"):
        assert credentials.redact_text(keep) == keep and credentials.shape(keep) is None


def test_secret_names_by_words():
    for name in ("pwd", "bearer", "DB_PASS", "GITHUB_PAT", "api_key", "hfToken", "WANDB_API_KEY", "x-auth",
                 "db.password", "PRIVATE_KEY", "session_cookie"):
        assert credentials.is_secret_key(name), name
    for name in ("tokenizer", "row_tokens", "path", "PYTHONPATH", "TOKENIZERS_PARALLELISM", "keep_checkpoints",
                 "passage", "compass", "author", "monkey", "pin_memory", "spatial"):
        assert not credentials.is_secret_key(name), name


def test_one_rule_for_secret_names_and_environment_names_by_any_word():
    """One rule (credentials.is_secret_key) for every name: a recipe's keys by their words, and the
    names muse-stack does not define (environment variables, a caller's free-form keys) also by a
    secret word anywhere in them. Every name secret as a key is secret as an environment name. A
    name that says where a secret is kept (``HF_TOKEN_PATH``, ``SSH_KEYFILE``,
    ``GOOGLE_APPLICATION_CREDENTIALS``) holds a path, not the secret: its value is checked by its shape."""
    keys = ("pwd", "bearer", "DB_PASS", "GITHUB_PAT", "api_key", "hfToken", "WANDB_API_KEY", "PRIVATE_KEY")
    loose = ("MY_AUTH_MODE", "AWS_SESSION_ID", "MONKEY", "pad_token_id")
    for name in keys + loose:
        assert credentials.is_secret_key(name, env=True), name
    for name in loose:
        assert not credentials.is_secret_key(name), name
    for name in ("NCCL_DEBUG", "PYTHONPATH", "TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "OMP_NUM_THREADS",
                 "HF_TOKEN_PATH", "SSH_KEYFILE", "GOOGLE_APPLICATION_CREDENTIALS", "NCCL_IB_PKEY"):
        assert not credentials.is_secret_key(name, env=True), name
    # the fingerprint records such variables by name only, and a recipe's env refuses their literals
    env = {name: "abc-123-xyz" for name in ("MY_AUTH_MODE", "DB_PASS", "NCCL_DEBUG")}
    assert environment.collect(env)["secrets_set"] == ["DB_PASS", "MY_AUTH_MODE"]
    assert environment.secret_values(env) == ["abc-123-xyz"]
    with pytest.raises(RecipeError) as exc:
        load_recipe("tiny-cpu", ["env.MY_AUTH_MODE=abc-123-xyz"])
    assert exc.value.field == "env.MY_AUTH_MODE"
    assert load_recipe("tiny-cpu", ["env.DB_PASS=${env:DB_PASS}"]).env["DB_PASS"] == "${env:DB_PASS}"
    # a location is written as given; a token given as one is still refused by its shape
    assert load_recipe("tiny-cpu", ["env.HF_TOKEN_PATH=/x/y"]).env["HF_TOKEN_PATH"] == "/x/y"
    with pytest.raises(RecipeError) as exc:
        load_recipe("tiny-cpu", [f"env.HF_TOKEN_PATH={TOKEN}"])
    assert exc.value.field == "env.HF_TOKEN_PATH"


def test_high_entropy_strings_are_told_from_names_hashes_and_paths():
    rng = random.Random(20261202)  # fixed: the same strings on every machine
    alphabet = string.ascii_letters + string.digits
    tokens = ["".join(rng.choices(alphabet, k=40)) for _ in range(2000)]
    missed = [t for t in tokens if not credentials.shape(t)]
    # the detector's miss rate on random 40-character strings, measured on 5,000 of them: 0.06%;
    # 1% leaves room for another sample without letting a broken rule pass
    assert len(missed) <= len(tokens) // 100, missed[:5]
    legit = ["MuseSparkOpenForCausalLM", "/work/main/runs/demo-20261201-082246", "meta-llama/Llama-3.1-8B-Instruct",
             "a" * 64, "0123456789abcdef" * 4, "GPU-ffdb2fca-3b5e-8d9b-c808-54b5aaa25b79", "train[:100000]",
             "tiny-cpu-20261201-082246", "allenai/tulu-3-sft-mixture", "${env:HF_TOKEN}",
             "registry.example.com/muse-stack:gb200-0.1.0@sha256:" + "0f" * 32, "Token embeddings are tied",
             "bearer authentication is out of scope"]
    assert [v for v in legit if credentials.shape(v)] == []


def test_temporary_folders_are_paths_not_credentials():
    """``tempfile`` names a folder ``tmp`` + 8 of ``[a-z0-9_]``; ``/tmp/tmp4go0z3ol/run`` was once
    refused as a high-entropy string (1.6% of such paths, measured on 20,000). A run's ``--out``
    under a temporary folder must be accepted on every draw."""
    rng = random.Random(20261204)  # fixed: the same names on every machine
    chars = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile._RandomNameSequence.characters
    names = ["tmp" + "".join(rng.choices(chars, k=8)) for _ in range(5000)]
    paths = [f"/tmp/{n}/run" for n in names] + [f"/var/tmp/{n}/run/checkpoints/step-00000002" for n in names]
    assert [p for p in paths if credentials.shape(p)] == []
    assert credentials.shape("/tmp/tmp4go0z3ol/run") is None
    # a credential as a folder of the path is still one
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits
    secret_paths = [f"/tmp/tmp4go0z3ol/{''.join(rng.choices(alphabet, k=40))}" for _ in range(200)]
    assert sum(credentials.shape(p) is None for p in secret_paths) <= 2  # the 40-character miss rate above: 0.06%


def test_errors_and_safeio_do_not_import_each_other():
    """The redaction lives in one module that imports nothing of muse-stack; errors uses it, and the
    fingerprint's scrubber uses the same patterns instead of a copy."""
    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    pkg = ROOT / "muse_stack"
    assert "muse_stack.util.safeio" not in imports(pkg / "util" / "errors.py")
    assert not any(m.startswith("muse_stack") for m in imports(pkg / "util" / "credentials.py"))
    env_src = (pkg / "fingerprint" / "environment.py").read_text()
    assert "://" not in env_src.split('"""', 2)[2], "the URL credential pattern is written again"
    from muse_stack.fingerprint.environment import scrub_text

    assert PW not in scrub_text(f"https:/user:{PW}@host/x", [])


def test_a_malformed_recipe_file_is_not_quoted_back(cli, tmp_path):
    """PyYAML's error quotes the lines around the problem; the error names the line and column only."""
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "recipes" / "tiny-cpu.yaml").read_text() + f"env:\n  DB_PASS: [{PW}\n")
    rc, out, err = cli("show", bad)
    assert rc == 2 and PW not in out + err and "line " in err and "column" in err, err


def test_a_credential_shaped_key_in_a_recipe_file_is_not_shown(cli, tmp_path):
    key = "".join(random.Random(7).choices(string.ascii_letters + string.digits, k=40))  # high entropy, no prefix
    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny-cpu.yaml").read_text() + f"notes:\n  {key}: x\n")
    rc, out, err = cli("show", recipe)
    assert rc == 2 and key not in out + err and "notes.<redacted>" in err, err


def test_the_command_line_parser_does_not_echo_a_token(cli):
    rc, out, err = cli("run", "tiny-cpu", f"--{TOKEN}")
    assert rc == 2 and TOKEN not in out + err and "No such option" in err, err


def test_no_recipe_or_model_field_is_secret_named(cli):
    """Token ids and key/value heads are model fields, not secrets: every field of the recipe
    schema, of ModelConfig and every Megatron-Bridge key takes an override."""
    import pydantic

    from muse_stack.models.muse_spark.config import ModelConfig
    from muse_stack.recipes.bridge import BRIDGE_KEYS
    from muse_stack.recipes.schema import Recipe

    def fields(model, prefix=""):
        for name, info in model.model_fields.items():
            yield prefix + name
            for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
                if isinstance(arg, type) and issubclass(arg, pydantic.BaseModel):
                    yield from fields(arg, f"{prefix}{name}.")

    names = [*fields(Recipe), *(f"model.overrides.{n}" for n in ModelConfig.model_fields), *BRIDGE_KEYS]
    assert [n for n in names if any(credentials.is_secret_key(p) for p in n.split("."))] == []
    rc, _, err = cli("show", "tiny-cpu", "model.overrides.num_key_value_heads=4", "model.overrides.pad_token_id=0")
    assert rc == 0, err
    rc, out, err = cli("show", "tiny-cpu", "env.DB_PASS=4417290")  # a number is a literal too
    assert rc == 2 and "4417290" not in out + err, err


HEX40 = "9f3c" + "0b7e5a1d" * 4 + "42d1"  # a W&B API key's shape: 40 hex digits, read as a hash by itself
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # AWS's documented example secret access key
WEBHOOK = "https://hooks.slack.com/services/T024BE7LD/B01AB2CD3EF/abcdEFGHijklMNOPqrstUVwx"


@pytest.mark.parametrize("override, field, secret", [
    (f"data.dataset=redis://:{PW}@cache.example.com:6379/0", "data.dataset", PW),
    (f"notes.alerts={WEBHOOK}", "notes.alerts", "abcdEFGHijklMNOPqrstUVwx"),
    (f"notes.setup=export WANDB_API_KEY={HEX40}", "notes.setup", HEX40),
    (f"description=aws_secret_access_key = {AWS_SECRET}", "description", AWS_SECRET),
    (f"env.SLACK_HOOK={WEBHOOK}", "env.SLACK_HOOK", "abcdEFGHijklMNOPqrstUVwx"),
])
def test_empty_user_urls_webhooks_and_secret_assignments_are_refused(cli, tmp_path, override, field, secret):
    """``scheme://:password@host`` (an empty user name), a Slack webhook URL and a secret pasted as
    ``NAME=value`` text were neither refused nor redacted: they reached recipe.yaml, the sbatch script
    and the terminal."""
    for args in (["show", "tiny-cpu", override], ["run", "tiny-cpu", override, "--out", tmp_path / "r"],
                 ["launch", "tiny-cpu", "--slurm", override, "-o", tmp_path / "job.sbatch"]):
        _refused(cli, args, secret, tmp_path, field)
        assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("flag", ["--runs-dir", "--data-dir", "--checkpoint-dir", "--images-dir"])
def test_a_launch_folder_holding_a_credential_is_refused_before_anything_is_written(cli, tmp_path, flag):
    for value in (f"/shared/WANDB_API_KEY={HEX40}", f"/shared/{TOKEN}", f"s3://:{PW}@bucket.example.com/x"):
        secret = HEX40 if HEX40 in value else TOKEN if TOKEN in value else PW
        rc, out, err = cli("launch", "tiny-cpu", "--slurm", flag, value, "-o", tmp_path / "job.sbatch")
        assert rc == 2 and secret not in out + err and f"{flag} = '<redacted>'" in err, (rc, err)
        assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize("flag", ["--account", "--partition", "--run-name"])
def test_a_slurm_value_holding_a_token_is_refused_naming_its_option(cli, tmp_path, flag):
    rc, out, err = cli("launch", "tiny-cpu", "--slurm", flag, TOKEN, "-o", tmp_path / "job.sbatch")
    assert rc == 2 and TOKEN not in out + err and f"{flag} = '<redacted>'" in err, (rc, err)
    assert not (tmp_path / "job.sbatch").exists()


def test_the_last_guard_on_a_launch_file_refuses_instead_of_rewriting():
    """Where the rendered file as a whole holds a credential that no single value showed, it is not
    written with a ``<redacted>`` in it: the launch is refused, naming the line (shown redacted)."""
    from muse_stack.util.errors import UsageError
    from muse_stack.util.safeio import refuse_rewrite

    assert refuse_rewrite("RUNS_DIR=/shared/sk-experiments-december-2026\n", field="--slurm", what="x") == \
        "RUNS_DIR=/shared/sk-experiments-december-2026\n"
    with pytest.raises(UsageError) as exc:
        refuse_rewrite(f"#!/bin/bash\nexport NOTE=\"Bearer {PW}\"\n", field="--slurm", what="the sbatch script")
    assert "line 2 of the sbatch script" in exc.value.render() and PW not in exc.value.render()


def test_diff_does_not_print_a_token_found_in_a_fingerprint_file(cli, tmp_path):
    import json

    doc = json.loads((ROOT / "tests/fixtures/fingerprints/cpu-debian12-torch2.13.json").read_text())
    other = json.loads(json.dumps(doc))
    other["host"]["hostname"] = TOKEN
    other["host"]["os"] = f"--hook={WEBHOOK}"
    other["host"]["kernel"] = f"https://:{PW}@cache.example.com"
    (tmp_path / "a.json").write_text(json.dumps(doc))
    (tmp_path / "b.json").write_text(json.dumps(other))
    for extra in ([], ["--json"]):
        rc, out, err = cli("diff", tmp_path / "a.json", tmp_path / "b.json", *extra)
        assert rc in (0, 1, 2) and "Traceback" not in err, err
        assert "hostname" in out and "<redacted>" in out, out
        for secret in (TOKEN, PW, "abcdEFGHijklMNOPqrstUVwx"):
            assert secret not in out + err, out


def test_a_fingerprint_records_new_credential_shapes_by_name_only():
    env = {"NCCL_NOTIFY": WEBHOOK, "HF_CACHE_URL": f"redis://:{PW}@cache.example.com:6379",
           "NCCL_IB_PKEY": "0x8001", "HF_TOKEN_PATH": "/home/u/.cache/huggingface/token"}
    got = environment.collect(env)
    assert got["secrets_set"] == ["HF_CACHE_URL", "NCCL_NOTIFY"]
    assert got["variables"] == {"HF_TOKEN_PATH": "/home/u/.cache/huggingface/token", "NCCL_IB_PKEY": "0x8001"}


def test_the_last_guard_redacts_the_new_shapes_in_written_text_and_errors(tmp_path):
    from muse_stack.util import atomic

    texts = {f"redis://:{PW}@cache.example.com:6379/0": PW, f"alerts go to {WEBHOOK} now": "abcdEFGHijklMNOPqrstUVwx",
             f"export WANDB_API_KEY={HEX40}": HEX40, f"aws_secret_access_key = {AWS_SECRET}": AWS_SECRET,
             f"https://s3cr3t-t0ken-value-1234@example.com/ds": "s3cr3t-t0ken-value-1234"}
    for text, secret in texts.items():
        assert secret not in InputError(f"cannot read {text}", field="x", value=text, fix="x").render()
        atomic.write_text(tmp_path / "f.txt", text)
        assert secret not in (tmp_path / "f.txt").read_text()
    for keep in ("ssh://git@github.com/meta/muse-stack.git", "- key: nvidia.com/gpu", "key: WANDB_API_KEY",
                 '"google-auth": "2.35.0.post1"', "RUNS_DIR=/shared/sk-experiments-december-2026"):
        assert credentials.redact_text(keep) == keep
