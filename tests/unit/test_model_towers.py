"""The vision tower, audio tower and projector against transformers' Muse Spark (5.24.0), on tiny
configs in float64: same parameter names, same function, and negative controls showing that the
comparison resolves each detail (channel interleave, RoPE base and axes, window size, position
table layout, causal padding, the norm's eps).

Inputs are made as transformers' processors make them: audio by ``MuseSparkFeatureExtractor``;
images and videos by the image and video processors' own ``smart_resize`` and ``patchify``
(read from the installed transformers). The processor classes themselves need torchvision, whose
only wheels here are CUDA builds that do not load against the CPU torch; where torchvision
loads, ``test_processor_functions_match_the_processor_class`` checks the two agree.

Bounds. Two float64 computations of the same function differ by rounding only. Along the
longest dependency chain of n roundings (each dot product of length K counts K; a norm over D
counts 2D) the relative error is at most n u / (1 - n u), u = 2^-53; it is carried to the
output, scaled by the output's largest magnitude, and multiplied by a growth factor of 4 per
block (each residual block at these weight scales passes an input error on with a gain below
4; a wrong assumption here makes the test fail, never pass). Measured (this machine): differences
~1e-15 (audio: 0); bounds 6e-11 to 7e-11 for the vision tower, 2e-8 for the audio path's 8
blocks; transformers' own float32 steps ~5e-8 (vision) and ~5e-7 (audio); controls 8e-5 (RoPE
theta 1% off) to 5 (channel interleave), each at least 1000 times its bound.

transformers forces float32 at a few points whatever the model dtype (``torch.float`` /
``.float()`` in the vision RoPE, ``apply_rotary_pos_emb_vision`` and ``MuseSparkRMSNorm``,
modeling_muse_spark.py:86-104, 659-670, 844-893). :func:`hf_float64` widens exactly those to
float64 for the float64 comparison; ``test_vision_tower_matches_transformers_as_shipped`` runs
transformers unpatched with a float32 bound.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import math
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    MuseSparkAudioConfig,
    MuseSparkConfig,
    MuseSparkFeatureExtractor,
    MuseSparkForConditionalGeneration,
    MuseSparkTextConfig,
    MuseSparkVisionConfig,
)
from transformers.models.muse_spark import modeling_muse_spark as hf_modeling
from transformers.utils.constants import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD

from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark import audio as audio_mod
from muse_stack.models.muse_spark import perception as perception_mod
from muse_stack.models.muse_spark import vision as vision_mod
from muse_stack.models.muse_spark.norms import rms_norm as rms
from muse_stack.models.muse_spark.perception import (
    MuseSparkPerception,
    scatter_media,
    text_input_ids,
)
from muse_stack.models.muse_spark.vision import MuseSparkVisionModel
from muse_stack.models.muse_spark.tower_config import AudioConfig, TowersConfig, VisionConfig

pytestmark = pytest.mark.usefixtures("one_thread")

U64 = 2.0**-53
U32 = 2.0**-24
GROWTH_PER_BLOCK = 4

# Tiny configs. Vision: 3 layers (window, window, full), width 32, 2 heads of 16, a 6 x 6 position
# table, so windows are 6 x 6 patches. Audio: 4 stages, 48 samples per token, one stage without blocks.
VISION = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=48,
              pos_emb_height=6, pos_emb_width=6)
AUDIO = dict(patch_sizes=[4, 3, 2, 2], hidden_sizes=[8, 12, 16, 24], depths=[1, 2, 0, 1], mlp_ratio=2.0,
             conv_kernel_size=5, out_hidden_size=40)
TEXT = dict(vocab_size=64, bos_token_id=1, eos_token_id=2, hidden_size=40, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_hidden_size=16, moe_intermediate_size=16, num_local_experts=4,
            num_experts_per_tok=2, rms_norm_eps=1e-4, sliding_window=8)
MEDIA = dict(image_token_id=60, video_token_id=61, audio_token_id=62, out_hidden_size=128, projector_hidden_size=24)


@contextlib.contextmanager
def hf_float64():
    """transformers with its fixed float32 steps widened to float64: ``Tensor.float()`` keeps a
    float64 tensor as is, and ``torch.float`` (the vision RoPE's inverse frequencies and angles)
    is float64. Active while a model is built (the RoPE buffer) and while it runs."""
    original = torch.Tensor.float

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "float", keep_float64), mock.patch.object(torch, "float", torch.float64):
        yield


def perturb(module: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Add N(0, scale^2) to every parameter, so no weight is 0 or 1 (norm gains, biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def bound(chain: int, blocks: int, reference: torch.Tensor, unit: float = U64) -> float:
    """n u / (1 - n u) x max|reference| x 4^blocks (see the module docstring)."""
    nu = chain * unit
    return nu / (1 - nu) * max(1.0, reference.abs().max().item()) * GROWTH_PER_BLOCK**blocks


def vision_chain(cfg: VisionConfig, max_keys: int) -> int:
    d, i = cfg.hidden_size, cfg.intermediate_size
    # norm1, q/k/v over D, scores over head_dim, softmax sum and values over the keys, proj over D,
    # norm2, fc1 over D, fc2 over I
    per_layer = 2 * d + d + cfg.head_dim + 2 * max_keys + d + 2 * d + d + i
    # patch embedding over the patch row, 4 bilinear taps, ln_pre, ln_post
    return cfg.patch_dim + 4 + 4 * d + cfg.num_hidden_layers * per_layer


def audio_chain(cfg: AudioConfig) -> tuple[int, int]:
    chain, blocks, c_in = 0, 0, 1
    for stage, (p, c, depth) in enumerate(zip(cfg.patch_sizes, cfg.hidden_sizes, cfg.depths, strict=True)):
        chain += c_in * p + 2 * c
        chain += depth * (cfg.conv_kernel_size + 2 * c + c + cfg.intermediate_size(stage))
        blocks += depth + 1
        c_in = c
    return chain + 2 * c_in + c_in + 2 * cfg.out_hidden_size, blocks


# ---------------------------------------------------------------- inputs, made as transformers makes them

def processor_functions() -> dict:
    """``smart_resize``, ``patchify`` and the class settings of transformers' Muse Spark image and video
    processors (``models/muse_glimmer``), taken from the installed files, not copied."""
    root = Path(transformers.__file__).parent / "models" / "muse_glimmer"
    found = {}
    for kind, filename, cls_name in (("image", "image_processing_muse_glimmer.py", "MuseGlimmerImageProcessor"),
                                     ("video", "video_processing_muse_glimmer.py", "MuseGlimmerVideoProcessor")):
        tree = ast.parse((root / filename).read_text())
        ns = {"torch": torch, "math": math, "itertools": itertools, "IMAGENET_STANDARD_MEAN": IMAGENET_STANDARD_MEAN,
              "IMAGENET_STANDARD_STD": IMAGENET_STANDARD_STD}
        (resize,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name]
        (patchify,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify"]
        settings = {}
        for node in cls.body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                if name in ("patch_size", "temporal_patch_size", "merge_size", "max_image_tokens",
                            "max_video_frame_tokens", "rescale_factor", "image_mean", "image_std"):
                    settings[name] = eval(compile(ast.Expression(node.value), filename, "eval"), ns)  # noqa: S307
        settings.setdefault("rescale_factor", 1 / 255)  # the video processor's base class default
        exec(compile(ast.Module([resize, patchify], []), filename, "exec"), ns)  # noqa: S102
        found[kind] = {"smart_resize": ns["smart_resize"], "patchify": ns["patchify"], **settings}
    return found


PROC = processor_functions()


def synthetic_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * 7 + yy * 3) % 256, (yy * 11) % 256, (xx * yy) % 256], axis=-1)
    noise = rng.integers(0, 40, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def normalised(images: list[Image.Image], settings: dict) -> torch.Tensor:
    """[n, 3, H, W] float: rescaled by 1/255 and normalised with the processor's mean and std."""
    x = torch.stack([torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1) for im in images]).double()
    mean = torch.tensor(settings["image_mean"], dtype=torch.float64)[:, None, None]
    std = torch.tensor(settings["image_std"], dtype=torch.float64)[:, None, None]
    return (x * settings["rescale_factor"] - mean) / std


def image_inputs(images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values``, ``image_grid_thw`` as the image processor makes them. The images' sides are
    multiples of patch_size x merge_size under the token cap, so ``smart_resize`` keeps them (checked)
    and no resampling filter is involved."""
    s = PROC["image"]
    rows, grids = [], []
    for im in images:
        size = s["smart_resize"](im.height, im.width, s["patch_size"] * s["merge_size"], s["max_image_tokens"])
        assert size == (im.height, im.width)
        patches, gh, gw = s["patchify"](None, normalised([im], s), s["patch_size"], s["temporal_patch_size"])
        rows.append(patches[0])
        grids.append([1, gh, gw])
    return torch.cat(rows), torch.tensor(grids)


def video_inputs(frames: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    s = PROC["video"]
    size = s["smart_resize"](frames[0].height, frames[0].width, s["patch_size"] * s["merge_size"],
                             s["max_video_frame_tokens"])
    assert size == (frames[0].height, frames[0].width)
    video = normalised(frames, s)[None]  # [1, frames, 3, H, W]
    patches, gt, gh, gw = s["patchify"](None, video, s["patch_size"], s["temporal_patch_size"])
    return patches[0], torch.tensor([[gt, gh, gw]])


def audio_inputs(lengths: list[int], samples_per_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(3)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.3 for n in lengths]
    fe = MuseSparkFeatureExtractor(samples_per_token=samples_per_token)
    out = fe(clips, sampling_rate=fe.sampling_rate, return_tensors="pt")
    return out["input_values"].double(), out["input_values_mask"]


# Image sides in patches are 4, 6, 8 and 12: with the 6-wide table, transformers' float32
# interpolation coordinates (i + 0.5) * 6 / n are exact for these n, so the float64 comparison is
# not limited by them. IMAGES: 12 x 8 patches (two by two windows, the last ones partial) and 4 x 6.
IMAGES = [synthetic_image(168, 112, 0), synthetic_image(56, 84, 1)]
# 3 frames of 12 x 8 patches -> padded to 2 temporal patches, each frame with partial windows
FRAMES = [synthetic_image(168, 112, 10 + k) for k in range(3)]


# ---------------------------------------------------------------- models

def hf_vision(**overrides):
    with hf_float64(), torch.random.fork_rng():
        torch.manual_seed(0)  # transformers initialises from the global generator
        model = hf_modeling.MuseSparkVisionModel(MuseSparkVisionConfig(**VISION, **overrides,
                                                                       attn_implementation="sdpa"))
    model = model.double().eval()
    perturb(model, 0)
    return model


HF_VISION = hf_vision()


def ours_from(hf_model, cls, cfg):
    model = cls(cfg).double().eval()
    model.load_state_dict(hf_model.state_dict(), strict=True)
    return model


def hf_full():
    config = MuseSparkConfig(text_config=MuseSparkTextConfig(**TEXT), vision_config=MuseSparkVisionConfig(**VISION),
                             audio_config=MuseSparkAudioConfig(**AUDIO), attn_implementation="sdpa", **MEDIA)
    with hf_float64(), torch.random.fork_rng():
        torch.manual_seed(1)
        model = MuseSparkForConditionalGeneration(config)
    model = model.double().eval()
    perturb(model, 1)
    return model


OURS_VISION = ours_from(HF_VISION, MuseSparkVisionModel, VisionConfig(**VISION))
OURS_VISION_VARLEN = ours_from(HF_VISION, MuseSparkVisionModel, VisionConfig(**VISION))
OURS_VISION_VARLEN.attention = "varlen"


def towers_config() -> TowersConfig:
    return TowersConfig(vision_config=VisionConfig(**VISION), audio_config=AudioConfig(**AUDIO), **MEDIA)


def ours_perception(hf_model) -> MuseSparkPerception:
    ours = MuseSparkPerception(towers_config(), text_hidden_size=TEXT["hidden_size"],
                               text_rms_norm_eps=TEXT["rms_norm_eps"]).double().eval()
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()
             if k.split(".")[1] in ("vision_tower", "audio_tower", "vision_adapter", "vision_projection",
                                    "perception_emb_norm")}
    ours.load_state_dict(state, strict=True)
    return ours


def run_hf_vision(model, pixel_values, grid, patched=True):
    ctx = hf_float64() if patched else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        return model(pixel_values=pixel_values.double(), grid_thw=grid).last_hidden_state


# ---------------------------------------------------------------- names and sizes

def test_state_dict_names_and_shapes_equal_transformers():
    hf = hf_full()
    ours = ours_perception(hf)  # loads strictly: every transformers tower tensor has a home
    hf_state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()
                if not k.startswith(("model.language_model.", "lm_head."))}
    ours_state = ours.state_dict()
    assert {k: tuple(v.shape) for k, v in ours_state.items()} == {k: tuple(v.shape) for k, v in hf_state.items()}
    # and back: transformers' towers load ours strictly
    for name in ("vision_tower", "audio_tower", "vision_adapter", "vision_projection"):
        getattr(hf.model, name).load_state_dict(getattr(ours, name).state_dict(), strict=True)
    assert "perception_emb_norm" not in {k.split(".")[0] for k in ours_state}  # weightless, as in transformers


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_at_the_defaults_match_transformers_on_meta():
    cfg = TowersConfig()
    with torch.device("meta"):
        hf_v = hf_modeling.MuseSparkVisionModel(MuseSparkVisionConfig())
        hf_a = hf_modeling.MuseSparkAudioModel(MuseSparkAudioConfig())
        hf_adapter = hf_modeling.MuseSparkVisionAdapter(MuseSparkConfig())
        hf_projection = torch.nn.Linear(MuseSparkConfig().projector_hidden_size, 8192, bias=False)
        ours = MuseSparkPerception(cfg, text_hidden_size=8192, text_rms_norm_eps=1e-5)
    assert _count(hf_v) == cfg.vision_config.parameter_count == _count(ours.vision_tower) == 1_852_639_744
    assert _count(hf_a) == cfg.audio_config.parameter_count == _count(ours.audio_tower) == 117_840_384
    assert _count(hf_adapter) + _count(hf_projection) == cfg.projector_parameter_count(8192) == 75_497_472
    assert _count(ours.vision_adapter) + _count(ours.vision_projection) == 75_497_472
    assert cfg.parameter_count(8192) == 2_045_977_600


@pytest.mark.parametrize("vision, audio", [
    (VISION, AUDIO),
    (dict(num_hidden_layers=2, hidden_size=24, num_attention_heads=3, intermediate_size=20, patch_size=4,
          patch_temporal=1, merge_size=3, pos_emb_height=5, pos_emb_width=5),
     dict(patch_sizes=[2, 5], hidden_sizes=[6, 10], depths=[3, 1], num_hidden_layers=2, mlp_ratio=1.5,
          conv_kernel_size=3, out_hidden_size=40)),
])
def test_parameter_count_formulas_match_transformers_on_tiny_configs(vision, audio):
    hf = hf_modeling.MuseSparkVisionModel(MuseSparkVisionConfig(**vision))
    assert VisionConfig(**vision).parameter_count == _count(hf)
    hf_audio = hf_modeling.MuseSparkAudioModel(MuseSparkAudioConfig(**audio))
    assert AudioConfig(**audio).parameter_count == _count(hf_audio)


def test_configs_round_trip_through_transformers():
    cfg = TowersConfig(vision_config=VisionConfig(**VISION, rope_theta=321.0), audio_config=AudioConfig(**AUDIO),
                       **MEDIA)
    hf = MuseSparkConfig(text_config=MuseSparkTextConfig(**TEXT), **cfg.to_hf())
    assert hf.vision_config.rope_parameters["rope_theta"] == 321.0
    assert hf.vision_config.layer_types == ["window_attention", "window_attention", "full_attention"]
    assert TowersConfig.from_hf(hf.to_dict()) == cfg
    # transformers' own default dicts read as our defaults, the vision RoPE base included
    assert TowersConfig.from_hf(MuseSparkConfig().to_dict()) == TowersConfig()
    assert VisionConfig().rope_theta == MuseSparkVisionConfig().rope_parameters["rope_theta"] == 10000.0


def test_config_errors_name_the_field():
    with pytest.raises(InputError, match="vision_config"):
        TowersConfig.from_hf({"audio_config": {}})
    with pytest.raises(InputError, match="vision_config.hidden_size"):
        TowersConfig.from_hf({"vision_config": {"hidden_size": "wide"}, "audio_config": {}})
    with pytest.raises(Exception, match="out_hidden_size"):
        TowersConfig(vision_config=VisionConfig(**VISION), out_hidden_size=6144)
    with pytest.raises(Exception, match="audio_config.out_hidden_size"):
        TowersConfig().check_text_hidden_size(4096)


# ---------------------------------------------------------------- function

@pytest.mark.parametrize("attention", ["grouped", "varlen"])
def test_vision_tower_matches_transformers_on_images_and_video(attention):
    """Either way the layers attend (``MuseSparkVisionModel.attention``: one call per group size, or the patches
    in window order and one variable-length call, whose CPU stand-in attends per window)."""
    hf = hf_vision()
    cfg = VisionConfig(**VISION)
    ours = ours_from(hf, MuseSparkVisionModel, cfg)
    ours.attention = attention
    for pixel_values, grid in (image_inputs(IMAGES), video_inputs(FRAMES)):
        expected = run_hf_vision(hf, pixel_values, grid)
        with torch.no_grad():
            got = ours(pixel_values.double(), grid)
        tol = bound(vision_chain(cfg, int(grid[:, 1:].prod(1).max())), cfg.num_hidden_layers, expected)
        assert got.shape == expected.shape == (int(grid.prod(1).sum()) // 4, 4 * cfg.hidden_size)
        torch.testing.assert_close(got, expected, rtol=0, atol=tol)


# sides (in patches) whose float32 interpolation coordinates are exact on the 6-wide table (see IMAGES)
EXACT_SIDES = [2, 4, 6, 8, 12, 16, 24]


@settings(max_examples=12, deadline=None)
@given(grids=st.lists(st.tuples(st.sampled_from([1, 2]), st.sampled_from(EXACT_SIDES), st.sampled_from(EXACT_SIDES)),
                      min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_vision_tower_matches_transformers_on_any_grid(grids, seed):
    """Packed media of any mix of frame counts and sides (several windows across, partial ones)."""
    hf = HF_VISION
    cfg = VisionConfig(**VISION)
    grid = torch.tensor(grids)
    gen = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(int(grid.prod(1).sum()), cfg.patch_dim, generator=gen, dtype=torch.float64)
    expected = run_hf_vision(hf, pixel_values, grid)
    tol = bound(vision_chain(cfg, int(grid[:, 1:].prod(1).max())), cfg.num_hidden_layers, expected)
    for ours in (OURS_VISION, OURS_VISION_VARLEN):
        with torch.no_grad():
            got = ours(pixel_values, grid)
        torch.testing.assert_close(got, expected, rtol=0, atol=tol)


def test_vision_tower_matches_transformers_as_shipped():
    """Unpatched transformers (its float32 RoPE, norms and interpolation weights) on sides whose
    interpolation is inexact in float32 (10 x 14 patches): the float32 bound holds, the float64 one
    does not, so the float64 test above measures function and not transformers' float32 rounding."""
    hf = hf_vision()
    cfg = VisionConfig(**VISION)
    ours = ours_from(hf, MuseSparkVisionModel, cfg)
    pixel_values, grid = image_inputs([synthetic_image(140, 196, 5)])
    expected = run_hf_vision(hf, pixel_values, grid, patched=False)
    with torch.no_grad():
        got = ours(pixel_values.double(), grid)
    chain = vision_chain(cfg, 140)
    error = (got - expected).abs().max().item()
    assert error <= bound(chain, cfg.num_hidden_layers, expected, unit=U32)
    assert error > bound(chain, cfg.num_hidden_layers, expected)


def test_audio_tower_and_features_match_transformers():
    hf = hf_full()
    ours = ours_perception(hf)
    cfg = AudioConfig(**AUDIO)
    input_values, mask = audio_inputs([100, 300], cfg.samples_per_token)  # padded to 336 = 7 tokens
    with torch.no_grad(), hf_float64():
        tower = hf.model.audio_tower(input_values=input_values).last_hidden_state
        features = hf.model.get_audio_features(input_values, mask).pooler_output
    with torch.no_grad():
        got_tower = ours.audio_tower(input_values)
        got = ours.audio_features(input_values, mask)
    chain, blocks = audio_chain(cfg)
    torch.testing.assert_close(got_tower, tower, rtol=0, atol=bound(chain, blocks, tower))
    assert got.shape == features.shape == (3 + 7, TEXT["hidden_size"])
    torch.testing.assert_close(got, features, rtol=0, atol=bound(chain + 2 * TEXT["hidden_size"], blocks, features))


def media_batch():
    """Two rows with text, image, video and audio placeholders, and the inputs behind them."""
    pixel_values, image_grid = image_inputs(IMAGES)        # 24 + 6 image tokens
    video_values, video_grid = video_inputs(FRAMES)        # 48 video tokens
    input_values, mask = audio_inputs([100, 300], 48)      # 3 + 7 audio tokens
    img, vid, aud = MEDIA["image_token_id"], MEDIA["video_token_id"], MEDIA["audio_token_id"]
    row0 = [1, 2] + [img] * 24 + [3] + [aud] * 3 + [4, 5]
    row1 = [6] + [img] * 6 + [7] + [vid] * 48 + [8] + [aud] * 7 + [9]
    row0 += [0] * (len(row1) - len(row0))
    inputs = dict(pixel_values=pixel_values.double(), image_grid_thw=image_grid,
                  pixel_values_videos=video_values.double(), video_grid_thw=video_grid,
                  input_values=input_values, input_values_mask=mask)
    return torch.tensor([row0, row1]), inputs


class _Captured(Exception):
    pass


def hf_inputs_embeds(hf, input_ids, inputs) -> torch.Tensor:
    """The embeddings transformers' MuseSparkModel hands its language model (media scattered)."""
    seen = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"]
        raise _Captured

    handle = hf.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad(), hf_float64(), pytest.raises(_Captured):
            hf(input_ids=input_ids, **inputs)
    finally:
        handle.remove()
    return seen["embeds"]


def ours_inputs_embeds(ours, hf, input_ids, inputs) -> torch.Tensor:
    table = hf.model.language_model.embed_tokens.weight.detach()
    text = rms(table[text_input_ids(input_ids, ours.config)], TEXT["rms_norm_eps"])
    with torch.no_grad():
        return ours.embed_media(input_ids, text, **inputs)


def scatter_bound(cfg: TowersConfig, expected: torch.Tensor) -> float:
    """The longer of the two paths into the embeddings: the vision tower (largest group: a 96-patch
    frame), the adapter (over out_hidden_size, then the projector width), the projection and the
    final rms (over the text width); plus the audio path; growth for the vision blocks and the two
    adapter layers."""
    chain = vision_chain(cfg.vision_config, 96) + cfg.out_hidden_size + 2 * cfg.projector_hidden_size \
        + 2 * TEXT["hidden_size"] + audio_chain(cfg.audio_config)[0]
    return bound(chain, cfg.vision_config.num_hidden_layers + 2, expected)


def test_media_scattered_into_text_embeddings_as_transformers_does():
    hf = hf_full()
    ours = ours_perception(hf)
    input_ids, inputs = media_batch()
    expected = hf_inputs_embeds(hf, input_ids, inputs)
    got = ours_inputs_embeds(ours, hf, input_ids, inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=scatter_bound(ours.config, expected))
    # every medium landed: the placeholders' rows differ from the embedding of id 0
    text_only = rms(hf.model.language_model.embed_tokens.weight.detach()[0], TEXT["rms_norm_eps"])
    for token_id in (MEDIA["image_token_id"], MEDIA["video_token_id"], MEDIA["audio_token_id"]):
        rows = got[input_ids == token_id]
        assert rows.shape[0] > 0 and (rows - text_only).abs().amax(dim=1).min() > 1e-3


def test_placeholder_count_mismatch_names_the_row():
    cfg = towers_config()
    img = cfg.image_token_id
    ids = torch.tensor([[1, img, img, 2], [img, img, img, 3]])
    embeds = torch.zeros(2, 4, 40, dtype=torch.float64)
    with pytest.raises(InputError, match=r"input_ids\[1\].*5 image placeholder tokens.*4 image feature rows"):
        scatter_media(ids, embeds, cfg, image=torch.ones(4, 40, dtype=torch.float64))
    with pytest.raises(InputError, match=r"input_ids\[1\].*6 image feature rows"):
        scatter_media(ids, embeds, cfg, image=torch.ones(6, 40, dtype=torch.float64))
    out = scatter_media(ids, embeds, cfg, image=torch.arange(5.0, dtype=torch.float64)[:, None].expand(5, 40))
    assert out[..., 0].tolist() == [[0, 0, 1, 0], [2, 3, 4, 0]]


# ---------------------------------------------------------------- negative controls

MARGIN = 1e3  # a control must miss the bound by at least this factor


_SHUFFLE = vision_mod.pixel_shuffle
_POSITIONS = vision_mod.resampled_position_table
_ROPE = vision_mod.axial_rope_cos_sin
_SCATTER = perception_mod.scatter_media


def _wrong_interleave(x, grid_thw, merge):
    """Channels k * D + d (patch-major) instead of transformers' d * m^2 + k."""
    right = _SHUFFLE(x, grid_thw, merge)
    n, width = right.shape
    return right.reshape(n, width // merge**2, merge**2).transpose(1, 2).reshape(n, width)


def _transposed_positions(table, height, width):
    """The table resampled to the patches' own (h, w) instead of transformers' (w, h) grid."""
    return _POSITIONS(table, width, height)


def _rows_first_rope(rows, cols, head_dim, theta, dtype):
    return _ROPE(cols, rows, head_dim, theta, dtype)


VISION_CONTROLS = {
    "pixel shuffle channels k*D + d": ("pixel_shuffle", _wrong_interleave),
    "position table resampled to (h, w)": ("resampled_position_table", _transposed_positions),
    "RoPE axes (row, col) swapped": ("axial_rope_cos_sin", _rows_first_rope),
    "RoPE theta 1% off": ("rope_theta", VisionConfig().rope_theta * 1.01),
    "window of 5 patches, not 6": ("window", 5),
    "window of 7 patches, not 6": ("window", 7),
}


@pytest.mark.parametrize("control", list(VISION_CONTROLS))
def test_vision_controls_fail(control, monkeypatch):
    hf = hf_vision()
    cfg = VisionConfig(**VISION)
    ours = ours_from(hf, MuseSparkVisionModel, cfg)
    pixel_values, grid = image_inputs(IMAGES)
    expected = run_hf_vision(hf, pixel_values, grid)
    tol = bound(vision_chain(cfg, 96), cfg.num_hidden_layers, expected)
    name, value = VISION_CONTROLS[control]
    if callable(value):
        monkeypatch.setattr(vision_mod, name, value)
    else:
        setattr(ours, name, value)
    with torch.no_grad():
        got = ours(pixel_values.double(), grid)
    assert (got - expected).abs().max().item() > MARGIN * tol, control


AUDIO_CONTROLS = {
    "centred (non-causal) conv padding": "centred",
    "perception norm eps = the audio eps": "eps",
}


@pytest.mark.parametrize("control", list(AUDIO_CONTROLS))
def test_audio_controls_fail(control):
    hf = hf_full()
    ours = ours_perception(hf)
    cfg = AudioConfig(**AUDIO)
    input_values, mask = audio_inputs([100, 300], cfg.samples_per_token)
    with torch.no_grad(), hf_float64():
        expected = hf.model.get_audio_features(input_values, mask).pooler_output
    if AUDIO_CONTROLS[control] == "centred":
        half = (cfg.conv_kernel_size - 1) // 2
        for module in ours.audio_tower.modules():
            if isinstance(module, audio_mod.CausalDepthwiseConv1d):
                module.pad = (half, half)
    else:
        ours.perception_emb_norm.eps = cfg.rms_norm_eps
    with torch.no_grad():
        got = ours.audio_features(input_values, mask)
    chain, blocks = audio_chain(cfg)
    assert (got - expected).abs().max().item() > MARGIN * bound(chain + 2 * TEXT["hidden_size"], blocks, expected)


def test_scatter_control_fails(monkeypatch):
    """Filling the placeholders column-major (down the batch first) instead of row-major misses."""
    hf = hf_full()
    ours = ours_perception(hf)
    input_ids, inputs = media_batch()
    expected = hf_inputs_embeds(hf, input_ids, inputs)

    def column_major(ids, embeds, config, **features):
        return _SCATTER(ids.T, embeds.transpose(0, 1), config, **features).transpose(0, 1)

    monkeypatch.setattr(perception_mod, "scatter_media", column_major)
    got = ours_inputs_embeds(ours, hf, input_ids, inputs)
    assert (got - expected).abs().max().item() > MARGIN * scatter_bound(ours.config, expected)


@pytest.mark.skipif(not transformers.utils.is_torchvision_available(), reason="torchvision is not installed")
def test_processor_functions_match_the_processor_class():
    try:
        from transformers import MuseGlimmerImageProcessor
        processor = MuseGlimmerImageProcessor()
    except Exception as exc:  # noqa: BLE001 - a torchvision that does not load against this torch
        pytest.skip(f"transformers' image processor does not load here: {exc}")
    out = processor(images=IMAGES, return_tensors="pt")
    pixel_values, grid = image_inputs(IMAGES)
    assert out["image_grid_thw"].tolist() == grid.tolist()
    torch.testing.assert_close(out["pixel_values"].double(), pixel_values, rtol=0, atol=1e-6)


def test_init_is_deterministic_and_follows_transformers_policy():
    from muse_stack.models.muse_spark.perception import init_perception_weights

    def build(seed):
        model = MuseSparkPerception(towers_config(), text_hidden_size=40, text_rms_norm_eps=1e-5)
        init_perception_weights(model, seed)
        return model.state_dict()

    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    for name, tensor in a.items():
        if name.endswith("bias"):
            assert torch.all(tensor == 0), name
        elif "norm" in name or name.endswith(("ln_pre.weight", "ln_post.weight")):
            assert torch.all(tensor == 1), name
        else:  # matmul, conv and embedding weights: N(0, 0.02)
            assert tensor.numel() < 64 or 0.015 < tensor.std().item() < 0.025, name


def test_bf16_weights_compute_in_fp32():
    """With bf16 weights the matmuls run in bf16 and everything between them (norms, RoPE, GELU,
    residuals, the position table) in fp32; the outputs are fp32."""
    ours = MuseSparkPerception(towers_config(), text_hidden_size=40, text_rms_norm_eps=1e-5)
    from muse_stack.models.muse_spark.perception import init_perception_weights

    init_perception_weights(ours, 0)
    ours = ours.to(torch.bfloat16)
    pixel_values, grid = image_inputs(IMAGES)
    input_values, mask = audio_inputs([100, 300], 48)
    with torch.no_grad():
        image = ours.image_features(pixel_values.float(), grid)
        audio = ours.audio_features(input_values.float(), mask)
    assert image.dtype == audio.dtype == torch.float32
    assert image.shape == (30, 40) and audio.shape == (10, 40)
    assert torch.isfinite(image).all() and torch.isfinite(audio).all()
