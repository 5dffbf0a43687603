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


# ---- the processor of an image-text export ------------------------------------------------------
def _processor_checks(out: Path) -> None:
    """What transformers reads of processor_config.json without torchvision (its image and video
    processors need it): the sections and class names its auto mappings give muse_spark, the
    feature extractor built by transformers' own class, and the image settings the run built its
    rows with."""
    from transformers import MuseSparkFeatureExtractor, MuseSparkProcessor
    from transformers.models.auto.auto_mappings import PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    from muse_stack.data.build import image_spec_for

    recipe = load_recipe("tiny-cpu-mm")
    processor, _ = MuseSparkProcessor.get_processor_dict(out)
    assert processor["processor_class"] == PROCESSOR_MAPPING_NAMES["muse_spark"]
    assert processor["image_processor"]["image_processor_type"] in IMAGE_PROCESSOR_MAPPING_NAMES["muse_spark"].values()
    # (without torchvision the video mapping holds None for muse_spark: the class is checked by name)
    assert processor["video_processor"]["video_processor_type"] == "MuseGlimmerVideoProcessor"
    for section, key in (("image_processor", "image_processor_type"), ("video_processor", "video_processor_type")):
        assert hasattr(transformers, processor[section][key])
    spec = image_spec_for(recipe)
    image = processor["image_processor"]
    assert (image["patch_size"], image["temporal_patch_size"], image["merge_size"], image["max_image_tokens"]) == \
        (spec.patch_size, spec.temporal_patch_size, spec.merge_size, spec.max_image_tokens)
    audio = MuseSparkFeatureExtractor.from_pretrained(out)
    assert audio.samples_per_token == recipe.towers_config_resolved().audio_config.samples_per_token == 16


@pytest.fixture(scope="module")
def mm_exports(mm_run, tmp_path_factory):
    """A merged export of the multimodal adapter run and a plain export of a full tiny-cpu-mm run."""
    from muse_stack.publish.hf import export_run

    root = tmp_path_factory.mktemp("mm-exports")
    merged, _, _ = export_run(mm_run, root / "merged", merge=True)
    outcome = run("tiny-cpu-mm", out=root / "full", steps=1, progress=False,
                  overrides=["training.measure_warmup_steps=0", "batch.gbs=2"])
    assert outcome.status == "completed"
    plain, _, _ = export_run(root / "full", root / "plain")
    return {"merged": merged, "plain": plain}


@pytest.mark.parametrize("kind", ["merged", "plain"])
def test_an_image_text_export_carries_transformers_processor_config(mm_exports, kind):
    _processor_checks(mm_exports[kind])


@pytest.mark.parametrize("kind", ["merged", "plain"])
def test_autoprocessor_feeds_an_image_as_the_run_built_its_rows(mm_exports, kind):
    """Where torchvision is installed (transformers' muse_spark image processor needs it):
    AutoProcessor loads the export and gives an image the grid and placeholders muse-stack's data
    build gives it."""
    pytest.importorskip("torchvision")
    from PIL import Image

    from muse_stack.data.build import image_spec_for
    from muse_stack.data.images import image_grid

    out = mm_exports[kind]
    processor = transformers.AutoProcessor.from_pretrained(out)
    image = Image.new("RGB", (90, 60), (200, 30, 90))
    batch = processor(images=[image], text=[processor.image_token], return_tensors="pt")
    spec = image_spec_for(load_recipe("tiny-cpu-mm"))
    grid = image_grid(image, spec)
    assert batch["image_grid_thw"][0].tolist() == list(grid)
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == spec.placeholders(grid)
