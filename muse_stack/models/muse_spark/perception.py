"""The projector and the placement of media in the text sequence (transformers' ``MuseSparkModel``
around its towers).

Modules, as children of ``model`` (transformers' names)::

    vision_tower          MuseSparkVisionModel        (muse_stack.models.muse_spark.vision)
    audio_tower           MuseSparkAudioModel         (muse_stack.models.muse_spark.audio)
    vision_adapter.fc1.weight   [P, out_hidden_size]  no bias
    vision_adapter.fc2.weight   [P, P]                no bias
    vision_projection.weight    [H_text, P]           no bias
    perception_emb_norm         weightless RMS norm (eps = the text rms_norm_eps); no parameters

Image or video features: ``rms(vision_projection(gelu(fc2(gelu(fc1(vision_tower(pixels)))))))``,
one row per merged patch, media in order. Audio features: ``rms(audio_tower(waveform))``, the
rms being the text embedding's weightless norm (same eps), keeping for each clip only its
``ceil(real samples / samples_per_token)`` tokens when ``input_values_mask`` is given.

Placement (:func:`scatter_media`): the text embeddings are computed with every media placeholder
id replaced by 0 (:func:`text_input_ids`); then the placeholders of each medium, in row-major
order over the batch, take that medium's feature rows in order (``masked_scatter``). The number
of placeholders must equal the number of feature rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.audio import MuseSparkAudioModel
from muse_stack.models.muse_spark.norms import rms_norm
from muse_stack.models.muse_spark.vision import MuseSparkVisionModel, dense
from muse_stack.models.muse_spark.tower_config import PERCEPTION_MODULES, TowersConfig


class MuseSparkVisionAdapter(nn.Module):
    """``vision_adapter``: ``gelu(fc2(gelu(fc1(x))))``, no biases."""

    def __init__(self, config: TowersConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.out_hidden_size, config.projector_hidden_size, bias=False)
        self.fc2 = nn.Linear(config.projector_hidden_size, config.projector_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(dense(self.fc1, x).to(x.dtype))
        return F.gelu(dense(self.fc2, h).to(x.dtype))


class PerceptionEmbNorm(nn.Module):
    """``perception_emb_norm``: weightless RMS norm (no parameters, nothing in the state dict)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, no weight"




def add_perception_modules(host: nn.Module, config: TowersConfig, *, text_hidden_size: int,
                           text_rms_norm_eps: float) -> None:
    """Register the towers and the projector on ``host`` (the model's ``model``) under transformers'
    names (:data:`PERCEPTION_MODULES`)."""
    config.check_text_hidden_size(text_hidden_size)
    host.vision_tower = MuseSparkVisionModel(config.vision_config)
    host.audio_tower = MuseSparkAudioModel(config.audio_config)
    host.vision_adapter = MuseSparkVisionAdapter(config)
    host.vision_projection = nn.Linear(config.projector_hidden_size, text_hidden_size, bias=False)
    host.perception_emb_norm = PerceptionEmbNorm(text_rms_norm_eps)


def image_features(host: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """[sum t*h*w / m^2, H_text]: the embeddings of images (or of videos: the same path, with
    ``video_grid_thw``) that replace their placeholders. ``host`` holds the perception modules."""
    merged = host.vision_tower(pixel_values, grid_thw)
    return host.perception_emb_norm(dense(host.vision_projection, host.vision_adapter(merged)))


def audio_features(host: nn.Module, input_values: torch.Tensor,
                   input_values_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[tokens, H_text]: the audio embeddings that replace ``<|audio|>`` placeholders, clips in batch
    order. With ``input_values_mask`` [B, S] (1 = real sample; right padding only, as the feature
    extractor makes it) each clip keeps ``ceil(real samples / samples_per_token)`` tokens."""
    out = host.audio_tower(input_values)  # [B, T, H_text]
    if input_values_mask is None:
        kept = out.reshape(-1, out.shape[-1])
    else:
        if input_values_mask.shape != input_values.shape:
            raise InputError("must have the shape of input_values", field="input_values_mask",
                             value=tuple(input_values_mask.shape), fix="pass the feature extractor's mask")
        step = host.audio_tower.config.samples_per_token
        tokens = (input_values_mask.sum(-1) + step - 1) // step
        keep = torch.arange(out.shape[1], device=out.device)[None, :] < tokens.to(out.device)[:, None]
        kept = out[keep]
    # the text embedding's weightless norm (transformers: embed_tokens.embed_norm, eps = text rms_norm_eps)
    return rms_norm(kept, host.perception_emb_norm.eps)


def media_token_ids(config: TowersConfig) -> dict[str, int]:
    return {"image": config.image_token_id, "video": config.video_token_id, "audio": config.audio_token_id}


def text_input_ids(input_ids: torch.Tensor, config: TowersConfig) -> torch.Tensor:
    """``input_ids`` with every media placeholder replaced by 0, the ids the text embedding sees
    (their embeddings are overwritten by :func:`scatter_media`)."""
    ids = input_ids.clone()
    ids[torch.isin(ids, torch.tensor(list(media_token_ids(config).values()), device=ids.device))] = 0
    return ids


PER_ITEM = {"image": "t*h*w / merge_size^2 per image", "video": "t*h*w / merge_size^2 per video",
            "audio": "ceil(samples / samples_per_token) per clip"}


def scatter_media(input_ids: torch.Tensor, inputs_embeds: torch.Tensor, config: TowersConfig, *,
                  image: torch.Tensor | None = None, video: torch.Tensor | None = None,
                  audio: torch.Tensor | None = None) -> torch.Tensor:
    """``inputs_embeds`` [B, T, H] with each medium's placeholders (row-major over the batch)
    replaced by its feature rows [n, H] in order. A medium given as None is left as is.

    Raises InputError naming the first batch row where the placeholders and the feature rows part
    ways when their counts differ."""
    out = inputs_embeds
    for kind, features in (("image", image), ("video", video), ("audio", audio)):
        if features is None:
            continue
        token_id = media_token_ids(config)[kind]
        mask = input_ids == token_id
        per_row = mask.sum(dim=1).tolist()
        if features.ndim != 2 or features.shape[1] != inputs_embeds.shape[-1]:
            raise InputError(f"{kind} features must be [rows, {inputs_embeds.shape[-1]}]", field=f"{kind} features",
                             value=tuple(features.shape), fix="compute them with this model's towers")
        if sum(per_row) != features.shape[0]:
            seen, row = 0, len(per_row) - 1
            for r, count in enumerate(per_row):
                seen += count
                if seen > features.shape[0]:
                    row = r
                    break
            raise InputError(
                f"{sum(per_row)} {kind} placeholder tokens (id {token_id}; per batch row {per_row}) but "
                f"{features.shape[0]} {kind} feature rows; row {row} of input_ids is the first whose "
                f"placeholders do not line up with the features",
                field=f"input_ids[{row}]", value=per_row[row],
                fix=f"render each {kind} with as many placeholders as its features have rows ({PER_ITEM[kind]})")
        out = out.masked_scatter(mask[..., None].to(out.device), features.to(out.device, out.dtype))
    return out


@torch.no_grad()
def init_perception_weights(host: nn.Module, seed: int = 0, std: float = 0.02, *, prefix: str = "") -> None:
    """(Re)initialise the perception modules on ``host`` as transformers' ``_init_weights`` does:
    linear, conv and embedding weights N(0, std), biases 0, LayerNorm and RMSNorm gains 1. Each
    tensor draws from its own generator seeded by (seed, ``prefix`` + its name under ``host``), as
    :func:`muse_stack.models.muse_spark.init.init_weights` does for the decoder (pass ``prefix="model."`` for the
    names of the full state dict); meta tensors are skipped."""
    from muse_stack.models.muse_spark.audio import RMSNorm
    from muse_stack.models.muse_spark.init import _generator

    for child in PERCEPTION_MODULES:
        root = getattr(host, child)
        for name, module in root.named_modules(prefix=child):
            params = [p for p in module.parameters(recurse=False) if not p.is_meta]
            if not params:
                continue
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
                values = torch.empty(module.weight.shape, dtype=torch.float32, device=module.weight.device)
                values.normal_(0.0, std, generator=_generator(seed, f"{prefix}{name}.weight", module.weight.device))
                module.weight.copy_(values)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            else:  # a parameter-holding module this function does not know would stay uninitialised
                raise TypeError(f"init_perception_weights: no rule for {name} ({type(module).__name__})")


class MuseSparkPerception(nn.Module):
    """The perception modules on their own (names as under ``model.``), with the media path:
    a host for :func:`image_features`, :func:`audio_features` and :func:`scatter_media`."""

    def __init__(self, config: TowersConfig, *, text_hidden_size: int, text_rms_norm_eps: float) -> None:
        super().__init__()
        self.config = config
        add_perception_modules(self, config, text_hidden_size=text_hidden_size, text_rms_norm_eps=text_rms_norm_eps)

    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return image_features(self, pixel_values, grid_thw)

    def audio_features(self, input_values: torch.Tensor, input_values_mask: torch.Tensor | None = None) -> torch.Tensor:
        return audio_features(self, input_values, input_values_mask)

    def embed_media(self, input_ids: torch.Tensor, text_embeds: torch.Tensor, **media: torch.Tensor | None
                    ) -> torch.Tensor:
        """``text_embeds`` (the normed embeddings of :func:`text_input_ids`) with the media in place
        (:func:`embed_media`)."""
        return embed_media(self, self.config, input_ids, text_embeds, **media)


#: what each medium's placeholders need, by transformers' argument names
MEDIA_ARGUMENTS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw"),
                   "audio": ("input_values", "input_values_mask")}
#: the batch keys the model takes as media (muse_stack.data.batches)
MEDIA_INPUTS = tuple(name for names in MEDIA_ARGUMENTS.values() for name in names)


def embed_media(host: nn.Module, config: TowersConfig, input_ids: torch.Tensor, text_embeds: torch.Tensor, *,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                input_values: torch.Tensor | None = None,
                input_values_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``text_embeds`` [B, T, H] (the normed embeddings of :func:`text_input_ids`) with each given
    medium's features (computed by the modules on ``host``) in its placeholders, as transformers'
    ``MuseSparkModel.forward`` places them. Refused: a medium without its grid, and placeholders of
    a medium whose inputs are not given (transformers would leave them the embedding of id 0)."""
    given = {"image": pixel_values, "video": pixel_values_videos, "audio": input_values}
    for kind, values in given.items():
        token_id = media_token_ids(config)[kind]
        if values is None and bool((input_ids == token_id).any()):
            name = MEDIA_ARGUMENTS[kind][0]
            raise InputError(f"input_ids hold {kind} placeholders (id {token_id}) but no {name} was given",
                             field=name, value=None,
                             fix=f"pass the {kind} inputs the placeholders stand for, or render the text without them")
    for values, grid, (name, grid_name) in ((pixel_values, image_grid_thw, MEDIA_ARGUMENTS["image"]),
                                            (pixel_values_videos, video_grid_thw, MEDIA_ARGUMENTS["video"])):
        if values is not None and grid is None:
            raise InputError(f"is needed with {name}", field=grid_name, value=None,
                             fix="pass both outputs of the image or video processor")
    image = image_features(host, pixel_values, image_grid_thw) if pixel_values is not None else None
    video = image_features(host, pixel_values_videos, video_grid_thw) if pixel_values_videos is not None else None
    audio = audio_features(host, input_values, input_values_mask) if input_values is not None else None
    return scatter_media(input_ids, text_embeds, config, image=image, video=video, audio=audio)


#: the order of the media in one concatenated feature table (:func:`media_index`, :func:`place_media`)
MEDIA_ORDER = ("image", "video", "audio")


def feature_rows(config: TowersConfig, *, image_grid_thw: torch.Tensor | None = None,
                 video_grid_thw: torch.Tensor | None = None, input_values: torch.Tensor | None = None,
                 input_values_mask: torch.Tensor | None = None, **_: torch.Tensor | None) -> dict[str, int]:
    """How many feature rows each medium's inputs give, read off the inputs alone (before any
    tower runs): ``t*h*w / merge_size^2`` per image or video, ``ceil(real samples /
    samples_per_token)`` per audio clip (every frame the tower makes without a mask)."""
    merge = config.vision_config.merge_size ** 2
    rows = {"image": 0, "video": 0, "audio": 0}
    for kind, grid in (("image", image_grid_thw), ("video", video_grid_thw)):
        if grid is not None:
            rows[kind] = int(grid.to(torch.int64).prod(dim=1).sum()) // merge
    if input_values is not None:
        step = config.audio_config.samples_per_token
        if input_values_mask is not None:
            rows["audio"] = int(((input_values_mask.sum(-1) + step - 1) // step).sum())
        else:
            rows["audio"] = input_values.shape[0] * -(-input_values.shape[-1] // step)
    return rows


def media_index(input_ids: torch.Tensor, config: TowersConfig, rows: dict[str, int]) -> torch.Tensor:
    """[B, T] int64: for each media placeholder of ``input_ids`` its row in the media's feature
    table (the image rows, then the video rows, then the audio rows: :data:`MEDIA_ORDER`), each
    medium's placeholders numbered in row-major order over the batch as :func:`scatter_media`
    places them; -1 at every text token. ``rows``: each medium's feature rows
    (:func:`feature_rows`), which must equal its placeholders (the InputError names the medium).

    The index travels with the tokens: split along the sequence (context or sequence
    parallelism) or flattened (packed rows), each part still says which row goes where."""
    index = torch.full(input_ids.shape, -1, dtype=torch.int64, device=input_ids.device)
    offset = 0
    for kind in MEDIA_ORDER:
        token_id = media_token_ids(config)[kind]
        mask = input_ids == token_id
        count = int(mask.sum())
        if count != rows.get(kind, 0):
            raise InputError(f"{count} {kind} placeholder tokens (id {token_id}) but {rows.get(kind, 0)} {kind} "
                             f"feature rows from the inputs", field="input_ids", value=count,
                             fix=f"render each {kind} with as many placeholders as its features have rows "
                                 f"({PER_ITEM[kind]})")
        index[mask] = torch.arange(offset, offset + count, device=input_ids.device)
        offset += count
    return index


def place_media(stream: torch.Tensor, features: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``stream`` [..., H] with each position whose ``index`` [...] is a row of ``features`` [n, H]
    taking that row (:func:`media_index`); every other position unchanged. The same values as
    :func:`scatter_media` for the whole batch, and for any part of it (a sequence chunk) with
    the matching part of the index; gradients reach both the stream and the features."""
    if index.shape != stream.shape[:-1]:
        raise ValueError(f"media index {tuple(index.shape)} does not match the stream {tuple(stream.shape)}")
    at = index >= 0
    if features.shape[0] == 0:
        return stream
    rows = features.to(stream.dtype)[index.clamp(min=0)]
    return torch.where(at[..., None], rows, stream)


def media_features(host: nn.Module, config: TowersConfig, *, pixel_values: torch.Tensor | None = None,
                   image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                   video_grid_thw: torch.Tensor | None = None, input_values: torch.Tensor | None = None,
                   input_values_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The feature table :func:`media_index` points into: the image, video and audio feature
    rows of the given inputs (the modules on ``host``), concatenated in :data:`MEDIA_ORDER`;
    None when no medium is given."""
    parts = []
    if pixel_values is not None:
        parts.append(image_features(host, pixel_values, image_grid_thw))
    if pixel_values_videos is not None:
        parts.append(image_features(host, pixel_values_videos, video_grid_thw))
    if input_values is not None:
        parts.append(audio_features(host, input_values, input_values_mask))
    if not parts:
        return None
    return torch.cat([p.to(parts[0].dtype) for p in parts])
