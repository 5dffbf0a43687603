"""`muse-stack run tiny-cpu-mm`: the reference engine trains the vision tower, the projector and the
decoder on the shipped image-text receipts with the audio tower frozen, and the export loads in
transformers' ``MuseSparkForConditionalGeneration`` with both towers and gives our logits on an
image batch."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MuseSparkForConditionalGeneration  # noqa: E402

from muse_stack.data.build import build_for_recipe  # noqa: E402
from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe  # noqa: E402
from muse_stack.run import checkpoints  # noqa: E402
from muse_stack.run.pipeline import run  # noqa: E402
from muse_stack.models.muse_spark.tower_config import TowersConfig  # noqa: E402
from test_model_multimodal import float64_parity, prepared  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("mm") / "run"
    outcome = run("tiny-cpu-mm", out=out, steps=STEPS, progress=False,
                  overrides=["training.measure_warmup_steps=2", f"training.checkpoint_interval={STEPS}"])
    assert outcome.status == "completed"
    return out


@pytest.mark.slow
def test_a_short_run_trains_the_vision_tower_and_keeps_the_audio_tower_frozen(trained):
    losses = [json.loads(line)["loss"] for line in (trained / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == STEPS
    # from ln(528) = 6.27 at initialisation down by about 0.9 nat in 12 steps; the step-to-step
    # noise of a 4-row batch is below 0.1 nat (the steps above change by 0.02-0.15 each)
    assert losses[0] > 6.0 and sum(losses[-3:]) / 3 < losses[0] - 0.5
    recipe = load_recipe("tiny-cpu-mm")
    start = MuseSparkForCausalLM(recipe.model_config_resolved(), seed=recipe.training.seed,
                                 towers=recipe.towers_config_resolved()).state_dict()
    end = load_checkpoint(checkpoints.latest(trained).path, towers=True).state_dict()
    assert start.keys() == end.keys()
    audio = [k for k in start if k.startswith("model.audio_tower.")]
    vision = [k for k in start if k.startswith(("model.vision_tower.", "model.vision_adapter.",
                                                "model.vision_projection."))]
    assert audio and vision
    assert all(torch.equal(start[k], end[k]) for k in audio)  # frozen: [audio_tower]
    assert all(not torch.equal(start[k], end[k]) for k in vision if k.endswith("weight"))


@pytest.mark.slow
def test_the_mfu_counts_the_flops_of_the_images_trained_on(trained):
    """results.json's FLOPs per token add the towers' FLOPs of every image of the run's batches
    (recounted here from the same rows in the same order) per token."""
    from muse_stack.models.muse_spark.flops import image_training_flops

    recipe = load_recipe("tiny-cpu-mm")
    results = json.loads((trained / "results.json").read_text())
    flops = results["flops_per_token"]
    built = build_for_recipe(recipe, progress=False)
    stream = built.batches(1, seed=recipe.training.data_seed, epochs=None)
    total, tokens = 0.0, 0
    for _ in range(STEPS * recipe.batch.gbs):
        mb = next(stream)
        tokens += mb["input_ids"].numel()
        total += image_training_flops(recipe.towers_config_resolved(), 64, mb["image_grid_thw"].tolist(),
                                      vision_trains=True, projector_trains=True)["training"]
    assert flops["towers_training"] == pytest.approx(total / tokens, rel=1e-12) and total > 0
    assert flops["training"] == pytest.approx(flops["towers_training"] + 3 * (flops["matmul_forward"]
                                              + flops["attention_forward"]), rel=1e-12)
    assert "perception towers" in results["flops_formula"]


@pytest.mark.slow
def test_a_resumed_run_repeats_the_uninterrupted_one(trained, tmp_path):
    out = tmp_path / "resumed"
    first = run("tiny-cpu-mm", out=out, steps=STEPS, progress=False, stop_after=5,
                overrides=["training.measure_warmup_steps=2", "training.checkpoint_interval=5"])
    assert first.status != "completed"
    assert run(None, resume=out, progress=False).status == "completed"
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
              for d in (trained, out)]
    assert losses[0] == losses[1]  # the towers' weights, optimizer state and the data position resume exactly


@pytest.mark.slow
def test_the_export_loads_in_transformers_with_both_towers_and_gives_our_logits(trained, tmp_path, cli):
    out = tmp_path / "hf"
    rc, _, err = cli("export", trained, "--hf", out)
    assert rc == 0, err
    towers = load_recipe("tiny-cpu-mm").towers_config_resolved()
    assert TowersConfig.from_hf(json.loads((out / "config.json").read_text())) == towers
    theirs, info = MuseSparkForConditionalGeneration.from_pretrained(out, output_loading_info=True,
                                                                     experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs = prepared(theirs)
    ours = load_checkpoint(out, towers=True).double().eval()
    # a batch of the run's own rows: pixel values and placeholders as the data builder makes them
    built = build_for_recipe(load_recipe("tiny-cpu-mm"), progress=False)
    batch = next(iter(built.batches(1, seed=None)))
    ids = batch["input_ids"]
    inputs = {"pixel_values": batch["pixel_values"].double(), "image_grid_thw": batch["image_grid_thw"]}
    with torch.no_grad(), float64_parity(theirs):
        a = ours(ids, **inputs).logits
        b = theirs(input_ids=ids, **inputs).logits
        # a control: the same pixels with the patch rows of each image in reverse order
        flipped = {**inputs, "pixel_values": inputs["pixel_values"].flip(0)}
        c = theirs(input_ids=ids, **flipped).logits
    # float64 throughout: the longest rounding chain (a few thousand operations through two vision
    # layers, the projector and four decoder layers) at 1.1e-16 each stays orders below 1e-9, while a
    # wrong patch order moves the logits by far more
    assert (a - b).abs().max().item() < 1e-9
    assert (c - b).abs().max().item() > 1e-4
