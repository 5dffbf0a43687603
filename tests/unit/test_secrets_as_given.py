"""Legitimate values that the secret rule refused or rewrote: a folder named ``sk-...`` written as
``<redacted>`` into an sbatch script (which then failed ``bash -n``), Slurm accounts and partitions
replaced the same way, and names and values that say where a secret is kept or that are not secrets
at all (``messages_key``, ``NCCL_IB_PKEY``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``HF_TOKEN_PATH``,
``ssh://git@...``, ``bos_token``, Nix store paths, ULIDs, job temporary folders). Each is either
written as given or refused before anything is written; these are written as given."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from muse_stack.recipes.catalogue import load_recipe
from muse_stack.util import credentials
from muse_stack.util.errors import RecipeError

SK_FOLDER = "/shared/sk-experiments-december-2026"


@pytest.mark.parametrize("flag", ["--runs-dir", "--data-dir", "--checkpoint-dir", "--images-dir"])
def test_a_folder_named_sk_is_written_into_the_sbatch_as_given(cli, tmp_path, flag):
    job = tmp_path / "job.sbatch"
    rc, out, err = cli("launch", "proxy-8gpu", "--slurm", flag, SK_FOLDER, "-o", job)  # a GPU job mounts them all
    assert rc == 0, err
    text = job.read_text()
    assert SK_FOLDER in text and "<redacted>" not in text
    assert subprocess.run([shutil.which("bash"), "-n", str(job)], capture_output=True).returncode == 0


def test_slurm_account_and_partition_are_written_as_given(cli, tmp_path):
    job = tmp_path / "job.sbatch"
    rc, out, err = cli("launch", "tiny-cpu", "--slurm", "--account", "sk-experiments-december-2026",
                       "--partition", "sk-h200-reserved", "-o", job)
    assert rc == 0, err
    text = job.read_text()
    assert "#SBATCH --account=sk-experiments-december-2026" in text, text
    assert "#SBATCH --partition=sk-h200-reserved" in text and "<redacted>" not in text


LEGITIMATE_OVERRIDES = [
    "data.details.messages_key=conversations",
    "env.NCCL_IB_PKEY='0x8001'",
    "env.GOOGLE_APPLICATION_CREDENTIALS=/etc/gcp/service-account.json",
    "env.HF_TOKEN_PATH=/home/alice/.cache/huggingface/token",
    "env.AWS_SHARED_CREDENTIALS_FILE=/home/alice/.aws/credentials",
    "provenance.url=ssh://git@github.com/meta/muse-stack.git",
    "data.template_kwargs.bos_token=<|begin_of_text|>",
    "data.template_kwargs.eos_token=<|eot_id|>",
    "env.PYTHONPATH=/nix/store/3x7dwzq014bblazs7kq20p9hyzz0qh8g-python3-3.11.9/lib/python3.11/site-packages",
    "notes.ticket=01HF3QZ8TMK4V9B6X2N7PJ5RWC",
    "env.TMPDIR=/tmp/slurm-12345/tmp.AbC123xyz",
    "description=artifacts under /shared/sk-experiments-december-2026",
]


@pytest.mark.parametrize("override", LEGITIMATE_OVERRIDES)
def test_legitimate_values_are_accepted_and_kept_as_given(cli, override):
    rc, out, err = cli("show", "tiny-cpu", override)
    assert rc == 0, err
    key, _, value = override.partition("=")
    node = load_recipe("tiny-cpu", [override]).model_dump(mode="json")
    for part in key.split("."):
        node = node[part]
    assert node == value.strip("'")


def test_the_data_builder_reads_a_literal_messages_key_and_the_recipe_refuses_a_reference():
    from muse_stack.data.build import plan_for_recipe

    recipe = load_recipe("tiny-cpu", ["data.details.messages_key=conversations"])
    assert plan_for_recipe(recipe, require_tokenizer=False).messages_key == "conversations"
    with pytest.raises(RecipeError) as exc:  # refused with the recipe, before a run directory is made
        load_recipe("tiny-cpu", ["data.details.messages_key=${env:MESSAGES_KEY}"])
    assert exc.value.field.startswith("data.details") and "conversations" in exc.value.render()


def test_a_job_temporary_folder_and_a_ulid_run_name_are_accepted_for_run_out(tmp_path):
    """``run --out`` and ``--resume`` refuse a credential-shaped path: a job's temporary folder with a
    run name under it, and a ULID, are paths."""
    for path in ("/tmp/slurm-12345/tmp.HWurXQ3GXt/runs/tiny-cpu-20261201-082246-xx18yi",
                 "/scratch/runs/01HF3QZ8TMK4V9B6X2N7PJ5RWC", "/tmp/tmp.24Ts1Dq0ty/runs/tiny-cpu-20261201-082246-99m4lb"):
        assert credentials.shape(path) is None, path


def test_location_names_and_special_tokens_are_not_secret_names():
    for name in ("messages_key", "bos_token", "eos_token", "pad_token", "NCCL_IB_PKEY", "UCX_IB_PKEY",
                 "HF_TOKEN_PATH", "GOOGLE_APPLICATION_CREDENTIALS", "AWS_SHARED_CREDENTIALS_FILE", "SSH_KEY_FILE"):
        assert not credentials.is_secret_key(name), name
        assert not credentials.is_secret_key(name, env=True), name
    for name in ("HF_TOKEN", "api_key", "WANDB_API_KEY", "ssh_key", "DB_PASSWORD", "access_token", "client_secret"):
        assert credentials.is_secret_key(name) and credentials.is_secret_key(name, env=True), name
