"""A checkpoint to start from is checked once, the same way, by `run` (before the run directory
exists) and by `launch` (before it writes a job): a NaN in config.json, a broken shard index and
an integer-typed weight are refused by both, naming what is wrong; loading refuses the integer
weight too rather than training on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint, save_checkpoint
from muse_stack.models.muse_spark.checkpoint import INDEX_FILE, check_readable
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.util.errors import InputError, MuseStackError


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """tiny-cpu's model, saved in shards (an index and six files)."""
    path = tmp_path_factory.mktemp("start") / "good"
    save_checkpoint(MuseSparkForCausalLM(load_recipe("tiny-cpu").model_config_resolved(), seed=3), path,
                    max_shard_bytes=200_000)
    assert (path / INDEX_FILE).is_file()
    return path


def _nan_in_config(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = float("nan")
    (path / "config.json").write_text(json.dumps(config))  # json writes NaN, and Python's json reads it


def _index_names_a_missing_shard(path: Path) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00006.safetensors"
    (path / INDEX_FILE).write_text(json.dumps(index))


def _index_names_the_wrong_shard(path: Path) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    here = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["lm_head.weight"] = next(f for f in index["weight_map"].values() if f != here)
    (path / INDEX_FILE).write_text(json.dumps(index))


def _integer_weight(path: Path) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    file = path / index["weight_map"]["lm_head.weight"]
    tensors = load_file(str(file))
    tensors["lm_head.weight"] = (tensors["lm_head.weight"] * 1000).to(torch.int32)
    save_file(tensors, str(file), metadata={"format": "pt"})


DAMAGE = {
    "nan in config.json": (_nan_in_config, "config.json text_config.rms_norm_eps", "finite"),
    "index names a missing shard": (_index_names_a_missing_shard, "checkpoint.shard", "model-00009-of-00006"),
    "index names the wrong shard": (_index_names_the_wrong_shard, "checkpoint.index", "lm_head.weight"),
    "integer weight": (_integer_weight, "checkpoint.tensor", "lm_head.weight is stored as I32"),
}


@pytest.fixture(params=sorted(DAMAGE))
def damaged(request, good, tmp_path):
    damage, field, words = DAMAGE[request.param]
    path = tmp_path / "ckpt"
    shutil.copytree(good, path)
    damage(path)
    return path, field, words


def test_the_shared_check_names_the_damage(damaged):
    path, field, words = damaged
    with pytest.raises(MuseStackError) as err:
        check_readable(path)
    assert err.value.field == field and words in str(err.value)


def test_run_and_launch_refuse_it_alike(cli, damaged, tmp_path):
    path, field, words = damaged
    out = tmp_path / "run"
    rc, _, run_err = cli("run", "tiny-cpu", "--steps", "1", "--pretrained-checkpoint", path, "--out", out,
                         "--no-progress")
    assert rc != 0 and field in run_err and words in " ".join(run_err.split()) and not out.exists()
    job = tmp_path / "job.sbatch"
    rc, _, launch_err = cli("launch", "tiny-cpu", "--slurm", "--pretrained-checkpoint", path, "-o", job)
    assert rc != 0 and field in launch_err and words in " ".join(launch_err.split()) and not job.exists()


def test_launch_accepts_what_run_accepts(cli, good, tmp_path):
    job = tmp_path / "job.sbatch"
    rc, _, err = cli("launch", "tiny-cpu", "--slurm", "--pretrained-checkpoint", good, "-o", job)
    assert rc == 0 and job.is_file(), err


def test_loading_refuses_an_integer_weight(good, tmp_path):
    """Copied into a float parameter, 1000 x w rounded to an integer would train as a weight 1000
    times too large; reading it as the model's own dtype would leave an integer parameter."""
    path = tmp_path / "ckpt"
    shutil.copytree(good, path)
    _integer_weight(path)
    with pytest.raises(InputError, match="lm_head.weight is stored as I32"):
        load_checkpoint(path)
    from muse_stack.models.muse_spark import load_weights_into

    with pytest.raises(InputError, match="lm_head.weight is stored as I32"):
        load_weights_into(MuseSparkForCausalLM(load_recipe("tiny-cpu").model_config_resolved(), seed=0), path)
