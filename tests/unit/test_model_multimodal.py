"""The reference model with its perception towers (``MuseSparkForCausalLM(config, towers=...)``) is
transformers' whole ``MuseSparkForConditionalGeneration``: the same state dict (loaded strictly both
ways), the same logits on a sequence holding an image, a video and an audio clip, checkpoints that
each side's loader reads with nothing missing, and an export that carries the run's own towers.

Float64 parity. transformers casts to float32 in its norms and router (``.float()``, ``.type``),
and in the vision RoPE through ``torch.float``; :func:`float64_parity` widens the first two for
float64 tensors and makes ``torch.float`` float64 inside the vision tower only (the text RoPE
computes in float32 in both models, as ``tests/unit/test_hf_transformers.py`` compares it), after
recomputing transformers' vision RoPE frequencies in float64 (:func:`prepared`).

Bound. The rounding chains into the decoder's input are the towers' (the vision tower, the
adapter and projection, the perception norm; the audio tower and its norm), counted as
``tests/unit/test_model_towers.py`` counts them, each multiplied by its growth factor, 4 per block of
its path (as there); the decoder adds ``logits_rounding_chain``. With n that sum and u = 2^-53
the relative error is at most n u / (1 - n u), carried to a logit at the softcap (which bounds
every logit, as in ``tests/unit/test_hf_transformers.py``). Measured on this machine: differences
3e-15 against a bound of 1.2e-8; the negative control (media filled in column-major order)
misses it by 4e7 times, and even transformers' weights rounded through float32 (7e-7) exceed it.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration  # noqa: E402

from muse_stack.util.errors import InputError  # noqa: E402
from muse_stack.models.muse_spark.hf_config import full_config  # noqa: E402
from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint, load_weights_into, save_checkpoint  # noqa: E402
from muse_stack.models.muse_spark import perception as perception_mod  # noqa: E402
from muse_stack.models.muse_spark.checkpoint import is_text_tensor, keeps_fp32  # noqa: E402
from muse_stack.models.muse_spark.config import ModelConfig  # noqa: E402
from muse_stack.models.muse_spark.tower_config import AudioConfig, TowersConfig, VisionConfig  # noqa: E402
from test_model_towers import (  # noqa: E402
    AUDIO,
    GROWTH_PER_BLOCK,
    MEDIA,
    VISION,
    audio_chain,
    media_batch,
    vision_chain,
)
from tiny_model import float64_throughout, logits_rounding_chain  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

U64 = 2.0**-53
MARGIN = 1e3  # the negative control must miss the bound by at least this factor
# 4 decoder layers (transformers' default pattern: sliding, sliding, full, sliding), width 40 (the
# audio tower's output width), a 4-token window over the 81-token rows
TEXT = dict(vocab_size=97, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            moe_hidden_size=16, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=None, first_padding_token_id=None,
            num_hidden_layers=4)


# the towers' test configs (48 samples per audio token, as media_batch makes the clips); the audio
# tower with conv blocks in its first and last stage only, which keeps its growth factor small
AUDIO_HERE = {**AUDIO, "depths": [1, 0, 0, 1], "out_hidden_size": TEXT["hidden_size"]}


def text_config() -> ModelConfig:
    return ModelConfig().with_overrides(**TEXT)


def towers_config(**media) -> TowersConfig:
    return TowersConfig(vision_config=VisionConfig(**VISION), audio_config=AudioConfig(**AUDIO_HERE),
                        **{**MEDIA, **media})


@contextlib.contextmanager
def float64_parity(*hf_models):
    """transformers' float32 casts keep float64 tensors as they are; ``torch.float`` is float64
    inside each model's vision tower (see the module doc)."""
    towers = [hf.model.vision_tower for hf in hf_models]
    for tower in towers:
        original = tower.forward

        def forward(*args, _original=original, **kwargs):
            with mock.patch.object(torch, "float", torch.float64):
                return _original(*args, **kwargs)

        tower.forward = forward
    try:
        with float64_throughout():
            yield
    finally:
        for tower in towers:
            del tower.forward


def prepared(hf: MuseSparkForConditionalGeneration) -> MuseSparkForConditionalGeneration:
    """``hf`` in float64, its vision RoPE frequencies computed in float64 as ours are."""
    hf = hf.double().eval()
    rotary = hf.model.vision_tower.rotary_emb
    with mock.patch.object(torch, "float", torch.float64):
        inv_freq, _ = type(rotary).compute_axial_rope_parameters(hf.config.vision_config)
    rotary.inv_freq = inv_freq.double()
    rotary.original_inv_freq = inv_freq.double().clone()
    return hf


def hf_config(cfg: ModelConfig, towers: TowersConfig) -> MuseSparkConfig:
    config = MuseSparkConfig(**full_config(cfg, towers.to_hf()))
    for sub in (config, config.text_config):
        sub._experts_implementation = "eager"  # the grouped-mm kernel takes no float64
    return config


def perturbed_ours(seed: int = 0) -> MuseSparkForCausalLM:
    """The whole model in float64 with every weight perturbed (no gain at 0 or 1, no zero bias)."""
    ours = MuseSparkForCausalLM(text_config(), seed=seed, towers=towers_config()).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for layer in ours.language_model.layers:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.05 * torch.randn(bias.shape, generator=g, dtype=bias.dtype))
    return ours.eval()


def pair(seed: int = 0):
    """Ours, and transformers' holding ours' state dict, loaded strictly."""
    ours = perturbed_ours(seed)
    theirs = MuseSparkForConditionalGeneration(hf_config(ours.config, ours.towers_config)).double()
    result = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return ours, prepared(theirs)


def bound(cfg: ModelConfig, towers: TowersConfig, tokens: int) -> float:
    """n u / (1 - n u) x softcap, n the decoder's chain plus each tower path's chain times its
    growth factor 4^blocks (see the module doc)."""
    vision, audio = towers.vision_config, towers.audio_config
    # the vision tower (largest attention group: a 96-patch frame), the adapter over out_hidden_size
    # and the projector width, the projection, the perception norm over the text width; its blocks:
    # the vision layers and the adapter's two layers
    vision_path = vision_chain(vision, 96) + towers.out_hidden_size + 2 * towers.projector_hidden_size \
        + 2 * cfg.hidden_size
    audio_path, audio_blocks = audio_chain(audio)
    audio_path += 2 * cfg.hidden_size  # the perception norm
    n = vision_path * GROWTH_PER_BLOCK ** (vision.num_hidden_layers + 2) \
        + audio_path * GROWTH_PER_BLOCK**audio_blocks + logits_rounding_chain(cfg, tokens)
    nu = n * U64
    return nu / (1 - nu) * cfg.final_logit_softcapping


def logits_of(ours, theirs, input_ids, inputs):
    with torch.no_grad(), float64_parity(theirs):
        a = ours(input_ids, **inputs).logits
        b = theirs(input_ids=input_ids, **inputs).logits
    return a, b


def test_whole_model_matches_transformers_in_float64():
    ours, theirs = pair()
    input_ids, inputs = media_batch()  # row 1: an image, a video and an audio clip in one sequence
    for token_id in (MEDIA["image_token_id"], MEDIA["video_token_id"], MEDIA["audio_token_id"]):
        assert (input_ids[1] == token_id).any()
    a, b = logits_of(ours, theirs, input_ids, inputs)
    assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape == (*input_ids.shape, TEXT["vocab_size"])
    assert (a - b).abs().max().item() <= bound(ours.config, ours.towers_config, input_ids.shape[1])
    # transformers' state dict is ours, name for name and shape for shape
    assert {k: tuple(v.shape) for k, v in theirs.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    # the media matter: the same model without them (placeholders refused, so text ids only) differs
    text_ids = input_ids.clone()
    text_ids[torch.isin(text_ids, torch.tensor(list(perception_mod.media_token_ids(ours.towers_config).values())))] = 0
    with torch.no_grad():
        plain = ours(text_ids).logits
    assert (plain - a).abs().max().item() > MARGIN * bound(ours.config, ours.towers_config, input_ids.shape[1])


def test_negative_control_media_filled_column_major_misses_the_bound(monkeypatch):
    """Filling the placeholders down the batch first instead of row-major is caught."""
    ours, theirs = pair()
    input_ids, inputs = media_batch()
    right = perception_mod.scatter_media

    def column_major(ids, embeds, config, **features):
        return right(ids.T, embeds.transpose(0, 1), config, **features).transpose(0, 1)

    monkeypatch.setattr(perception_mod, "scatter_media", column_major)
    a, b = logits_of(ours, theirs, input_ids, inputs)
    assert (a - b).abs().max().item() > MARGIN * bound(ours.config, ours.towers_config, input_ids.shape[1])


def test_the_bound_resolves_float32_weights():
    """The bound is tight enough to see transformers' copy of the weights rounded to float32 (the
    mistake of loading float64 weights into a float32 model before widening it)."""
    ours, theirs = pair()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(p.float().double())
    input_ids, inputs = media_batch()
    a, b = logits_of(ours, theirs, input_ids, inputs)
    assert (a - b).abs().max().item() > bound(ours.config, ours.towers_config, input_ids.shape[1])


def test_text_only_behaviour_is_unchanged_and_media_need_towers():
    cfg = text_config()
    text_only = MuseSparkForCausalLM(cfg, seed=3)
    whole = MuseSparkForCausalLM(cfg, seed=3, towers=towers_config())
    assert text_only.towers_config is None and whole.towers_config == towers_config()
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in text_only.state_dict().items())
    assert {k for k in whole.state_dict() if not is_text_tensor(k)} and \
        not {k for k in text_only.state_dict() if not is_text_tensor(k)}
    ids = torch.randint(3, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(whole(ids).logits, text_only(ids).logits)
    input_ids, inputs = media_batch()
    with pytest.raises(InputError, match="pixel_values"):
        text_only(input_ids, **inputs)
    with pytest.raises(InputError, match="video placeholders.*pixel_values_videos"):
        whole(input_ids, **{k: v for k, v in inputs.items() if "video" not in k})
    with pytest.raises(InputError, match="image_grid_thw"):
        whole(input_ids, **{**inputs, "image_grid_thw": None})


def test_tower_init_is_deterministic_per_name():
    a = MuseSparkForCausalLM(text_config(), seed=5, towers=towers_config()).state_dict()
    b = MuseSparkForCausalLM(text_config(), seed=5, towers=towers_config()).state_dict()
    c = MuseSparkForCausalLM(text_config(), seed=6, towers=towers_config()).state_dict()
    towers = [k for k in a if not is_text_tensor(k)]
    assert all(torch.equal(a[k], b[k]) for k in a)
    matrices = [k for k in towers if a[k].dim() > 1]
    assert matrices and all(not torch.equal(a[k], c[k]) for k in matrices)
    # each tensor from its own generator, seeded by its state-dict name: two same-shaped tensors differ
    q, k = "model.vision_tower.layers.0.attn.q_proj.weight", "model.vision_tower.layers.0.attn.k_proj.weight"
    assert a[q].shape == a[k].shape and not torch.equal(a[q], a[k])
    from muse_stack.models.muse_spark.init import _generator

    std = text_config().initializer_range
    for name in (q, "model.audio_tower.proj.weight", "model.vision_projection.weight"):
        expected = torch.empty(a[name].shape).normal_(0.0, std, generator=_generator(5, name, torch.device("cpu")))
        assert torch.equal(a[name], expected), name


def test_the_loss_trains_the_towers():
    model = MuseSparkForCausalLM(text_config(), seed=0, towers=towers_config())
    input_ids, inputs = media_batch()
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    labels = torch.roll(input_ids, -1, dims=1)
    out = model(input_ids, **inputs, labels=labels, loss_mask=torch.ones_like(labels, dtype=torch.bool))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name in ("vision_tower.patch_embedder.patch_embedding.weight", "audio_tower.proj.weight",
                 "vision_adapter.fc1.weight", "vision_projection.weight"):
        grad = model.model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


# ---- checkpoints in both directions ------------------------------------------------------------
def test_saved_checkpoint_loads_in_transformers_with_nothing_missing(tmp_path):
    ours = perturbed_ours(seed=2)
    # transformers loads the router and the residual gates in float32 whatever the dtype asked
    # (_keep_in_fp32_modules_strict), muse-stack the router (keeps_fp32): their stored values are
    # made float32-exact, so that loading loses nothing either side
    fp32_modules = MuseSparkForConditionalGeneration._keep_in_fp32_modules_strict
    with torch.no_grad():
        for name, tensor in ours.state_dict(keep_vars=True).items():
            if keeps_fp32(name) or any(module in name for module in fp32_modules):
                tensor.copy_(tensor.float())
    save_checkpoint(ours, tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["vision_config"]["num_hidden_layers"] == VISION["num_hidden_layers"]  # its own towers
    assert TowersConfig.from_hf(saved) == ours.towers_config
    theirs, info = MuseSparkForConditionalGeneration.from_pretrained(tmp_path / "ckpt", output_loading_info=True,
                                                                     experts_implementation="eager",
                                                                     dtype=torch.float64)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    input_ids, inputs = media_batch()
    a, b = logits_of(ours, prepared(theirs), input_ids, inputs)
    assert (a - b).abs().max().item() <= bound(ours.config, ours.towers_config, input_ids.shape[1])
    # and back into muse-stack: the same model, bitwise
    back = load_checkpoint(tmp_path / "ckpt", towers=True)
    assert back.towers_config == ours.towers_config and back.load_report.ignored == 0
    # (the router stays float32 whatever the stored dtype: load_checkpoint's rule)
    assert all(torch.equal(back.state_dict()[k], v.float() if keeps_fp32(k) else v)
               for k, v in ours.state_dict().items())
    into = MuseSparkForCausalLM(ours.config, seed=9, towers=ours.towers_config).double()
    load_weights_into(into, tmp_path / "ckpt")
    assert all(torch.equal(into.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_transformers_checkpoint_loads_with_its_towers(tmp_path):
    _, theirs = pair(seed=4)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_checkpoint(tmp_path / "hf", towers=True)
    report = ours.load_report
    assert ours.towers_config == towers_config()
    assert report.ignored == 0 and report.towers == len([k for k in theirs.state_dict() if not is_text_tensor(k)])
    assert "perception towers" in report.summary()
    input_ids, inputs = media_batch()
    a, b = logits_of(ours.double(), theirs, input_ids, inputs)
    assert (a - b).abs().max().item() <= bound(ours.config, ours.towers_config, input_ids.shape[1])
    # without towers=True: today's text decoder, the towers counted as ignored
    text = load_checkpoint(tmp_path / "hf")
    assert text.towers_config is None and text.load_report.ignored == report.towers


def test_towers_true_on_a_text_checkpoint_gives_the_text_model(tmp_path):
    save_checkpoint(MuseSparkForCausalLM(text_config(), seed=1), tmp_path / "text")
    model = load_checkpoint(tmp_path / "text", towers=True)
    assert model.towers_config is None and model.load_report.towers == 0 and model.load_report.ignored == 0


def test_loading_other_towers_into_a_model_is_refused(tmp_path):
    save_checkpoint(MuseSparkForCausalLM(text_config(), seed=1, towers=towers_config()), tmp_path / "a")
    model = MuseSparkForCausalLM(text_config(), seed=None, towers=towers_config(projector_hidden_size=16))
    with pytest.raises(InputError, match="towers differ.*projector_hidden_size"):
        load_weights_into(model, tmp_path / "a")


# ---- export ------------------------------------------------------------------------------------
def test_export_of_a_reference_run_carries_its_own_towers(tmp_path):
    from muse_stack.recipes.catalogue import load_recipe, recipe_yaml
    from muse_stack.run import checkpoints
    from muse_stack.publish.hf import export_run

    recipe = load_recipe("tiny-cpu")
    cfg = recipe.model_config_resolved()
    towers = TowersConfig(vision_config=VisionConfig(**VISION),
                          audio_config=AudioConfig(**{**AUDIO, "out_hidden_size": cfg.hidden_size}), **MEDIA)
    model = MuseSparkForCausalLM(cfg, seed=11, towers=towers)
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints" / checkpoints.folder_name(4)
    save_checkpoint(model, folder)  # what the reference engine writes for a model with towers
    (folder / "recipe.yaml").write_text(recipe_yaml(recipe))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 4}))
    (run_dir / "checkpoints" / "latest").write_text(json.dumps({"step": 4, "folder": folder.name}))
    out, step, _ = export_run(run_dir, tmp_path / "hf")
    assert step == 4
    assert TowersConfig.from_hf(json.loads((out / "config.json").read_text())) == towers  # not placeholders
    exported = load_checkpoint(out, towers=True)
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in model.state_dict().items())
    assert "this run's step 4 checkpoint" in (out / "README.md").read_text()
    theirs, info = MuseSparkForConditionalGeneration.from_pretrained(out, output_loading_info=True,
                                                                     experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
