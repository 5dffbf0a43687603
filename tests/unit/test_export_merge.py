"""`muse-stack export RUN --hf OUT --merge` of adapter runs on the CPU: the merged checkpoint has
every file the plain export has (the towers' tensors, tokenizer, generation config, model card)
and transformers 5.24 loads it with nothing missing, unexpected or mismatched; a multimodal adapter
run (whose base was hashed with its towers) merges too; and where the base really differs, the
refusal names what differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MuseSparkForConditionalGeneration  # noqa: E402

from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint, save_checkpoint  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe  # noqa: E402
from muse_stack.run.pipeline import run  # noqa: E402
from muse_stack.util.errors import InputError  # noqa: E402

PEFT = ["peft.scheme=lora", "peft.targets=[self_attn.q_proj,self_attn.v_proj,mlp.pre_expert_proj,"
        "mlp.experts.gate_up_proj,mlp.experts.down_proj]", "peft.per_expert=true", "peft.rank=4", "peft.alpha=8",
        "batch.gbs=2", "optimizer.warmup_steps=1", "training.measure_warmup_steps=1"]


def _adapter_run(root: Path, recipe: str, **kw) -> Path:
    out = root / recipe
    outcome = run(recipe, out=out, steps=2, progress=False, overrides=PEFT, **kw)
    assert outcome.status == "completed"
    return out


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    return _adapter_run(tmp_path_factory.mktemp("merge"), "tiny-cpu")


@pytest.fixture(scope="module")
def mm_run(tmp_path_factory):
    return _adapter_run(tmp_path_factory.mktemp("merge-mm"), "tiny-cpu-mm")


@pytest.fixture(scope="module")
def plain_files(tmp_path_factory):
    """The files a plain export of a full (non-adapter) tiny-cpu run holds."""
    from muse_stack.publish.hf import export_run

    root = tmp_path_factory.mktemp("plain")
    outcome = run("tiny-cpu", out=root / "run", steps=1, progress=False,
                  overrides=["training.measure_warmup_steps=0", "batch.gbs=2"])
    assert outcome.status == "completed"
    out, _, _ = export_run(root / "run", root / "hf")
    return sorted(p.name for p in out.iterdir())


def _loads_whole(out: Path) -> MuseSparkForConditionalGeneration:
    model, info = MuseSparkForConditionalGeneration.from_pretrained(out, output_loading_info=True,
                                                                    experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def test_a_merged_text_export_is_as_complete_as_the_plain_one(text_run, plain_files, tmp_path, cli):
    out = tmp_path / "merged"
    rc, _, err = cli("export", text_run, "--hf", out, "--merge")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == plain_files
    model = _loads_whole(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert model.generate(**prompt, max_new_tokens=2).shape[1] >= prompt["input_ids"].shape[1] + 1
    card = (out / "README.md").read_text()
    assert "tiny-cpu" in card and "steps | 2" in card
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    # the towers of a text run are the placeholders a plain export carries, from the run's seed
    assert "placeholder" in card


def test_a_multimodal_adapter_run_merges_with_its_own_towers(mm_run, tmp_path, cli):
    out = tmp_path / "merged"
    rc, _, err = cli("export", mm_run, "--hf", out, "--merge")
    assert rc == 0, err
    model = _loads_whole(out)
    assert model.config.vision_config.num_hidden_layers == 2  # tiny-cpu-mm's towers, not placeholders
    recipe = load_recipe("tiny-cpu-mm")
    base = MuseSparkForCausalLM(recipe.model_config_resolved(), seed=recipe.training.seed,
                                towers=recipe.towers_config_resolved()).state_dict()
    merged = load_checkpoint(out, towers=True).state_dict()
    towers = [k for k in base if k.startswith(("model.vision_", "model.audio_"))]
    assert towers and all(torch.equal(merged[k], base[k]) for k in towers)  # the frozen base's towers, as trained on
    for name in ("tokenizer.json", "generation_config.json", "README.md"):
        assert (out / name).is_file()


def test_a_base_that_really_differs_is_refused_naming_what_differs(tmp_path, cli):
    cfg = load_recipe("tiny-cpu").model_config_resolved()
    base = tmp_path / "base"
    save_checkpoint(MuseSparkForCausalLM(cfg, seed=5), base)
    run_dir = _adapter_run(tmp_path, "tiny-cpu", pretrained_checkpoint=str(base))
    ok = tmp_path / "ok"
    assert cli("export", run_dir, "--hf", ok, "--merge")[0] == 0
    # the checkpoint at the recorded path is replaced by another one of the same shapes
    save_checkpoint(MuseSparkForCausalLM(cfg, seed=6), base)
    from muse_stack.publish.hf import export_run

    with pytest.raises(InputError) as err:
        export_run(run_dir, tmp_path / "never", merge=True)
    message = str(err.value)
    assert f"the checkpoint at {base} holds other weights than when the run started" in message
    assert "language_model" in message and "lm_head" in message and not (tmp_path / "never").exists()
