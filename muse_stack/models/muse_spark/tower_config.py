"""The perception towers' configuration: transformers' ``vision_config``, ``audio_config`` and the
top-level media keys of Muse Spark's ``config.json``.

Field names and meanings are transformers' (``transformers/models/muse_spark/
configuration_muse_spark.py``: ``MuseSparkVisionConfig``, ``MuseSparkAudioConfig`` and the
media keys of ``MuseSparkConfig``). Defaults are the released model's. ``from_hf`` reads the
dicts of a checkpoint's ``config.json`` (keys transformers adds to every config, such as
``dtype`` or ``id2label``, are not architecture and are ignored); ``to_hf`` writes dicts that
transformers' classes accept.

One value transformers does not state: the vision tower's RoPE base. ``MuseSparkVisionConfig``
sets no ``rope_theta``, so transformers' generic RoPE default, 10000, is used. Here it is the
field :attr:`VisionConfig.rope_theta`, default 10000, written to and read from
``rope_parameters`` like transformers.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from muse_stack.util.errors import InputError, RecipeError

VisionLayerType = Literal["full_attention", "window_attention"]

#: RoPE base transformers falls back to when ``rope_parameters`` carries none (its generic default)
TRANSFORMERS_DEFAULT_ROPE_THETA = 10000.0
#: eps of every vision encoder layer's ``norm1``/``norm2``: fixed at 1e-5 in transformers'
#: ``MuseSparkVisionEncoderLayer`` (``layer_norm_eps`` applies to ``ln_pre``/``ln_post`` only)
VISION_BLOCK_NORM_EPS = 1e-5
#: image channels the patch embedding reads (RGB)
IMAGE_CHANNELS = 3
#: merged tokens per image at most, transformers' image processor's default (MuseGlimmerImageProcessor)
MAX_IMAGE_TOKENS = 4096


#: the perception modules under transformers' ``model.`` (the weightless norm holds no tensor)
PERCEPTION_MODULES = ("vision_tower", "audio_tower", "vision_adapter", "vision_projection", "perception_emb_norm")


def default_vision_layer_types(num_layers: int) -> list[VisionLayerType]:
    """transformers' pattern when ``layer_types`` is absent: full attention on every 4th layer
    ((i + 1) % 4 == 0) and on the last layer, window attention elsewhere."""
    return ["full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "window_attention"
            for i in range(num_layers)]


class VisionConfig(BaseModel):
    """``vision_config``: the vision tower (``MuseSparkVisionModel``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    patch_size: int = Field(14, gt=0, le=1024, description="pixels per patch side")
    pos_emb_height: int = Field(32, gt=0, le=4096, description="rows of the learned position table; also the "
                                "window side in patches")
    pos_emb_width: int = Field(32, gt=0, le=4096, description="columns of the learned position table (must "
                               "equal pos_emb_height, as transformers assumes)")
    num_attention_heads: int = Field(16, gt=0, le=1024)
    num_hidden_layers: int = Field(50, gt=0, le=1024)
    hidden_size: int = Field(1536, gt=0, le=1 << 16)
    intermediate_size: int = Field(8960, gt=0, le=1 << 18)
    hidden_act: Literal["gelu"] = Field("gelu", description="exact (erf) GELU, transformers' 'gelu'")
    patch_temporal: int = Field(2, gt=0, le=64, description="frames per temporal patch")
    merge_size: int = Field(2, gt=0, le=16, description="side of the pixel-shuffle merge")
    layer_norm_eps: float = Field(1e-5, gt=0, description="eps of ln_pre and ln_post")
    layer_types: list[VisionLayerType] | None = Field(
        None, description="per-layer attention; left out = transformers' pattern (full on (i+1) % 4 == 0 and "
                          "on the last layer), filled in on validation")
    rope_theta: float = Field(TRANSFORMERS_DEFAULT_ROPE_THETA, gt=0, description=(
        "base of the 2D axial RoPE. transformers' MuseSparkVisionConfig states none and falls back to its "
        "generic default 10000; this is that value, stated"))

    @model_validator(mode="before")
    @classmethod
    def _fill_layer_types(cls, data: Any) -> Any:
        # as transformers' __post_init__: an absent layer_types becomes the default pattern
        if isinstance(data, dict) and data.get("layer_types") is None:
            layers = data.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default)
            if isinstance(layers, int) and 0 < layers <= 1024:
                data = {**data, "layer_types": default_vision_layer_types(layers)}
        return data

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.hidden_size % self.num_attention_heads:
            raise RecipeError("must divide vision_config.hidden_size into whole heads",
                              field="vision_config.num_attention_heads", value=self.num_attention_heads,
                              fix=f"pick a divisor of hidden_size {self.hidden_size}")
        if self.head_dim % 4:
            raise RecipeError("the 2D axial RoPE splits each head into (w, h) halves of rotated pairs, so the "
                              "head width must be a multiple of 4",
                              field="vision_config.hidden_size / num_attention_heads", value=self.head_dim,
                              fix="choose hidden_size and num_attention_heads with head_dim % 4 == 0")
        if self.pos_emb_height != self.pos_emb_width:
            raise RecipeError("transformers' vision tower assumes a square position table",
                              field="vision_config.pos_emb_width", value=self.pos_emb_width,
                              fix=f"set pos_emb_width = pos_emb_height = {self.pos_emb_height}")
        if self.layer_types is None or len(self.layer_types) != self.num_hidden_layers:
            raise RecipeError("needs one entry per vision layer", field="vision_config.layer_types",
                              value=self.layer_types,
                              fix=f"give {self.num_hidden_layers} entries or leave it out")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of ``pixel_values``: frames x channels x patch_size^2 (1176)."""
        return self.patch_temporal * IMAGE_CHANNELS * self.patch_size**2

    @property
    def window_patches(self) -> int:
        """Side of a window-attention window in patches (transformers: window_size = pos_emb_height *
        patch_size pixels)."""
        return self.pos_emb_height

    @property
    def merged_hidden_size(self) -> int:
        """Width after the pixel shuffle: hidden_size x merge_size^2 (6144)."""
        return self.hidden_size * self.merge_size**2

    @property
    def parameter_count(self) -> int:
        """Parameters of ``model.vision_tower`` (1,852,639,744 at the defaults)."""
        d, i = self.hidden_size, self.intermediate_size
        per_layer = 2 * 2 * d + 4 * (d * d + d) + (d * i + i) + (i * d + d)  # norm1/2, q/k/v/proj, fc1, fc2
        embed = self.patch_dim * d + self.pos_emb_height * self.pos_emb_width * d
        return embed + 2 * 2 * d + self.num_hidden_layers * per_layer  # + ln_pre, ln_post

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> VisionConfig:
        """From a ``vision_config`` dict of transformers' ``config.json``."""
        values = {k: v for k, v in data.items() if k in cls.model_fields and k != "rope_theta"}
        rope = data.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise InputError("the vision tower's RoPE is axial", field="vision_config.rope_parameters.rope_type",
                             value=rope.get("rope_type"), fix="use rope_type 'axial' (transformers' only choice)")
        if "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        elif "rope_theta" in data:
            values["rope_theta"] = data["rope_theta"]
        return _validated(cls, values, "vision_config")

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict transformers' ``MuseSparkVisionConfig`` reads."""
        out = self.model_dump(exclude={"rope_theta"})
        out["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        out["max_position_embeddings"] = self.pos_emb_height * self.pos_emb_width
        out["model_type"] = "muse_spark_vision"
        return out


class AudioConfig(BaseModel):
    """``audio_config``: the audio tower (``MuseSparkAudioModel``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    patch_sizes: list[int] = Field([16, 6, 5, 4], description="samples (stage 0) or frames merged per stage")
    hidden_sizes: list[int] = Field([256, 512, 1024, 2048], description="width of each stage")
    depths: list[int] = Field([2, 2, 2, 2], description="ConvBlocks per stage")
    num_hidden_layers: int = Field(4, gt=0, le=64, description="stages (must equal len(hidden_sizes))")
    mlp_ratio: float = Field(4.0, gt=0)
    conv_kernel_size: int = Field(7, gt=0, le=1024)
    hidden_act: Literal["gelu"] = "gelu"
    rms_norm_eps: float = Field(1e-6, gt=0)
    out_hidden_size: int = Field(8192, gt=0, le=1 << 17, description="output width: the text hidden size")

    @model_validator(mode="after")
    def _check(self) -> AudioConfig:
        lengths = (len(self.patch_sizes), len(self.hidden_sizes), len(self.depths))
        if not lengths[0] == lengths[1] == lengths[2] == self.num_hidden_layers:
            raise RecipeError("patch_sizes, hidden_sizes and depths need one entry per stage",
                              field="audio_config.num_hidden_layers", value=self.num_hidden_layers,
                              fix=f"make the lists' lengths {lengths} all equal num_hidden_layers")
        for name in ("patch_sizes", "hidden_sizes"):
            if any(v <= 0 for v in getattr(self, name)):
                raise RecipeError("entries must be positive", field=f"audio_config.{name}",
                                  value=getattr(self, name), fix="use positive sizes")
        if any(v < 0 for v in self.depths):
            raise RecipeError("entries must be >= 0", field="audio_config.depths", value=self.depths,
                              fix="use non-negative depths")
        return self

    @property
    def samples_per_token(self) -> int:
        """Waveform samples per output token: the product of patch_sizes (1920 = 80 ms at 24 kHz)."""
        return math.prod(self.patch_sizes)

    def intermediate_size(self, stage: int) -> int:
        return int(self.hidden_sizes[stage] * self.mlp_ratio)

    @property
    def parameter_count(self) -> int:
        """Parameters of ``model.audio_tower`` (117,840,384 at the defaults)."""
        total = 0
        in_channels = 1
        for stage, (p, c, depth) in enumerate(zip(self.patch_sizes, self.hidden_sizes, self.depths, strict=True)):
            i = self.intermediate_size(stage)
            total += in_channels * p * c + c + c  # patch proj (+bias), its RMSNorm
            conv_block = (c * self.conv_kernel_size + c) + c + (c * i + i) + (i * c + c)  # dw conv, norm, fc1, fc2
            total += depth * conv_block
            in_channels = c
        last = self.hidden_sizes[-1]
        return total + last + (last * self.out_hidden_size + self.out_hidden_size) + self.out_hidden_size

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> AudioConfig:
        """From an ``audio_config`` dict of transformers' ``config.json``."""
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items() if k in cls.model_fields}
        return _validated(cls, values, "audio_config")

    def to_hf(self) -> dict[str, Any]:
        out = self.model_dump()
        out["model_type"] = "muse_spark_audio"
        return out


class TowersConfig(BaseModel):
    """The media part of Muse Spark's top-level config: the two towers, the projector and the media
    token ids (transformers' ``MuseSparkConfig`` keys other than ``text_config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    vision_config: VisionConfig = Field(default_factory=VisionConfig)
    audio_config: AudioConfig = Field(default_factory=AudioConfig)
    image_token_id: int = Field(200092, ge=0)
    video_token_id: int = Field(200091, ge=0)
    audio_token_id: int = Field(200038, ge=0)
    out_hidden_size: int = Field(6144, gt=0, le=1 << 18, description="vision width after the pixel shuffle "
                                 "(the adapter's input): vision hidden_size x merge_size^2")
    projector_hidden_size: int = Field(4096, gt=0, le=1 << 17, description="vision_adapter width")
    projector_hidden_act: Literal["gelu"] = "gelu"

    @model_validator(mode="after")
    def _check(self) -> TowersConfig:
        merged = self.vision_config.merged_hidden_size
        if self.out_hidden_size != merged:
            raise RecipeError("the adapter reads the pixel-shuffled vision output, hidden_size x merge_size^2 wide",
                              field="out_hidden_size", value=self.out_hidden_size,
                              fix=f"set out_hidden_size = {merged}")
        ids = {"image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
               "audio_token_id": self.audio_token_id}
        if len(set(ids.values())) != len(ids):
            raise RecipeError("the media token ids must differ", field="image/video/audio_token_id", value=ids,
                              fix="give each medium its own placeholder id")
        return self

    def check_text_hidden_size(self, text_hidden_size: int) -> None:
        """The audio tower's output is scattered onto the text embeddings as is (transformers checks the
        same in ``MuseSparkConfig.validate_architecture``)."""
        if self.audio_config.out_hidden_size != text_hidden_size:
            raise RecipeError("must equal the text hidden size: the audio features are scattered onto the text "
                              "embeddings", field="audio_config.out_hidden_size",
                              value=self.audio_config.out_hidden_size, fix=f"set it to {text_hidden_size}")

    def projector_parameter_count(self, text_hidden_size: int) -> int:
        """Parameters of ``model.vision_adapter`` and ``model.vision_projection`` (75,497,472 at the
        defaults, with text hidden size 8192); ``perception_emb_norm`` has none."""
        p = self.projector_hidden_size
        return self.out_hidden_size * p + p * p + p * text_hidden_size

    def parameter_count(self, text_hidden_size: int) -> int:
        """All perception parameters: both towers and the projector (2,045,977,600 at the defaults)."""
        return (self.vision_config.parameter_count + self.audio_config.parameter_count
                + self.projector_parameter_count(text_hidden_size))

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> TowersConfig:
        """From the top level of transformers' ``config.json`` (``text_config`` is not read here).
        ``vision_config`` and ``audio_config`` must be present, as transformers requires of a
        checkpoint that is to load without building the full towers."""
        for key in ("vision_config", "audio_config"):
            if not isinstance(data.get(key), dict):
                raise InputError("is missing from config.json (or not a mapping)", field=key, value=data.get(key),
                                 fix=f"write the {key} section; transformers otherwise builds the full-size tower")
        values = {k: v for k, v in data.items() if k in cls.model_fields and k not in ("vision_config", "audio_config")}
        values["vision_config"] = VisionConfig.from_hf(data["vision_config"])
        values["audio_config"] = AudioConfig.from_hf(data["audio_config"])
        return _validated(cls, values, "config")

    def to_hf(self) -> dict[str, Any]:
        """The media keys of the top-level ``config.json`` (merge with ``text_config`` and the rest)."""
        out = self.model_dump(exclude={"vision_config", "audio_config"})
        out["vision_config"] = self.vision_config.to_hf()
        out["audio_config"] = self.audio_config.to_hf()
        return out


def _validated(cls: type[BaseModel], values: dict[str, Any], where: str) -> Any:
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InputError(first["msg"], field=f"{where}.{loc}" if loc else where, value=first.get("input"),
                         fix=f"correct {where} in config.json") from None
