"""Image-text rows (``data.kind: multimodal``): CORD-v2's schema rendered with the model's chat
template and media tokens, and the ``pixel_values`` of each batch.

**Rows in.** A row has an ``image`` (a ``datasets`` Image value: encoded bytes, or a path; a
path in a local file is taken relative to that file's folder) and ``ground_truth``, a JSON string
with ``gt_parse`` (or ``gt_parses``, of which the first is used: Megatron-Bridge picks one at
random, unseeded, which no run could repeat). As Megatron-Bridge's ``make_cord_v2_dataset``
does, the conversation is a user turn with the image and the prompt (``data.details.prompt``,
default Bridge's "Describe this image.") and an assistant turn with the parse written by
:func:`json2token` (Donut's tags, keys in reverse order).

**Tokens.** The chat template renders each image content part as the processor's image token
(``<|patch|>``, or the tokenizer config's ``image_token``), once; that token is then expanded in
id space to ``<|image_start|>`` + ``<|patch|>`` x (t*h*w / merge^2) + ``<|image_end|>`` exactly as
transformers' ``MuseSparkProcessor.replace_image_token`` expands it in text (the three are special
tokens, so the ids are the same). The start and end ids come from the tokenizer; the placeholder
id must be the model's ``image_token_id``.

**Loss.** The ``muse_spark`` mask: assistant text tokens and their end of turn only. The media
tokens (start, placeholders, end) never carry loss, whatever turn they are in.

**Pixels** are made when a batch is collated, from the stored image bytes, by
:mod:`muse_stack.data.images` (the grid is fixed at build time and checked against the bytes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from muse_stack.data.chat import ChatTokenizer, Tokenized
from muse_stack.data.images import ImageSpec, image_bytes_of, image_grid, open_rgb, pixel_values
from muse_stack.util.errors import InputError, RecipeError

#: Megatron-Bridge's make_cord_v2_dataset user prompt
DEFAULT_PROMPT = "Describe this image."
#: transformers' MuseSparkProcessor token strings, used when the tokenizer config names none
PROCESSOR_TOKENS = {"image_token": "<|patch|>", "image_start_token": "<|image_start|>",
                    "image_end_token": "<|image_end|>", "video_token": "<|video|>", "audio_token": "<|audio|>",
                    "audio_start_token": "<|soft_audio_start|>", "audio_end_token": "<|soft_audio_end|>"}


def json2token(obj: Any, sort_json_key: bool = True) -> str:
    """A ground-truth parse as Donut's tag sequence, as Megatron-Bridge writes CORD-v2 answers:
    ``<s_key>value</s_key>`` with keys in reverse sorted order, list items joined by ``<sep/>``,
    a dict holding only ``text_sequence`` written as that text, scalars as ``str``."""
    if isinstance(obj, dict):
        if len(obj) == 1 and "text_sequence" in obj:
            return str(obj["text_sequence"])
        keys = sorted(obj, reverse=True) if sort_json_key else list(obj)
        return "".join(f"<s_{k}>{json2token(obj[k], sort_json_key)}</s_{k}>" for k in keys)
    if isinstance(obj, list):
        return "<sep/>".join(json2token(item, sort_json_key) for item in obj)
    return str(obj)


@dataclass(frozen=True)
class MediaIds:
    """The image token ids a build uses (from the tokenizer) and the media ids no text may hold."""

    patch: int
    start: int
    end: int
    strings: dict[str, str]
    forbidden: dict[int, str]  # id -> token, for ids that must not occur in rendered text

    def describe(self) -> dict[str, Any]:
        return {"image_token": [self.strings["image_token"], self.patch],
                "image_start_token": [self.strings["image_start_token"], self.start],
                "image_end_token": [self.strings["image_end_token"], self.end]}


def media_ids(tokenizer: ChatTokenizer, image_token_id: int) -> MediaIds:
    """The tokenizer's image tokens; its placeholder must be the model's ``image_token_id``."""
    from muse_stack.util.safeio import read_json

    cfg_path = tokenizer.directory / "tokenizer_config.json"
    config = read_json(cfg_path, field="data.tokenizer", what="tokenizer_config.json",
                       fix="restore tokenizer_config.json") if cfg_path.is_file() else {}
    strings = {k: (config.get(k) if isinstance(config.get(k), str) else v) for k, v in PROCESSOR_TOKENS.items()}
    ids = {}
    for key in ("image_token", "image_start_token", "image_end_token"):
        tid = tokenizer.tokenizer.token_to_id(strings[key])
        if tid is None:
            raise InputError(f"the tokenizer has no {strings[key]} token ({key}), which image-text rows need",
                             field="data.tokenizer", value=str(tokenizer.directory),
                             fix=f"use the model's tokenizer, or add {strings[key]} as a special token "
                                 "(data/make_tiny_receipts.py shows how)")
        ids[key] = int(tid)
    if ids["image_token"] != image_token_id:
        raise RecipeError(f"the tokenizer's image placeholder {strings['image_token']} is id {ids['image_token']}, "
                          f"the model's image_token_id is {image_token_id}", field="model.towers.image_token_id",
                          value=image_token_id,
                          fix=f"set model.towers.image_token_id: {ids['image_token']} in the recipe, or use the "
                              "model's own tokenizer")
    forbidden = {}
    for key in ("image_start_token", "image_end_token", "video_token", "audio_token", "audio_start_token",
                "audio_end_token"):
        tid = tokenizer.tokenizer.token_to_id(strings[key])
        if tid is not None:
            forbidden[int(tid)] = strings[key]
    return MediaIds(patch=ids["image_token"], start=ids["image_start_token"], end=ids["image_end_token"],
                    strings=strings, forbidden=forbidden)


@dataclass(frozen=True)
class MediaTokenized(Tokenized):
    """A conversation's ids and mask with its images: encoded bytes and (t, h, w) grids, in the
    order their placeholders occur."""

    images: tuple[bytes, ...] = field(default=())
    grids: tuple[tuple[int, int, int], ...] = field(default=())


def cord_messages(record: dict[str, Any], prompt: str, row: str) -> list[dict[str, Any]]:
    """The conversation of one CORD-v2 row (its image as the one image part of the user turn)."""
    truth = record.get("ground_truth")
    fix = "give ground_truth as a JSON string with gt_parse (an object) or gt_parses (a list), as CORD-v2 does"
    if not isinstance(truth, str):
        raise InputError(f"{row}: ground_truth is {type(truth).__name__}, not a JSON string", field="data ground_truth",
                         value=row, fix=fix)
    try:
        parsed = json.loads(truth)
    except json.JSONDecodeError as exc:
        raise InputError(f"{row}: ground_truth is not JSON ({exc.msg} at {exc.pos})", field="data ground_truth",
                         value=row, fix=fix) from exc
    parses = parsed.get("gt_parses") if isinstance(parsed, dict) else None
    if isinstance(parses, list) and parses:
        parse = parses[0]
    elif isinstance(parsed, dict) and isinstance(parsed.get("gt_parse"), dict):
        parse = parsed["gt_parse"]
    else:
        raise InputError(f"{row}: ground_truth has no gt_parse object or gt_parses list", field="data ground_truth",
                         value=row, fix=fix)
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
            {"role": "assistant", "content": [{"type": "text", "text": json2token(parse)}]}]


def tokenize_image_text(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], images: list[bytes],
                        ids: MediaIds, spec: ImageSpec, row: str) -> MediaTokenized:
    """Render, mask and expand one conversation; each image is decoded to fix its grid."""
    base = tokenizer.tokenize(messages)
    bad = sorted(set(int(i) for i in base.ids) & set(ids.forbidden))
    if bad:
        raise InputError(f"{row}: the rendered text holds the media token {ids.forbidden[bad[0]]}, which only the "
                         "image processor may place", field="data", value=row,
                         fix="remove media token strings from the row's text")
    where = np.flatnonzero(base.ids == ids.patch)
    if where.shape[0] != len(images):
        raise InputError(f"{row}: the chat template wrote {where.shape[0]} image token(s) "
                         f"{ids.strings['image_token']} for {len(images)} image(s)", field="data.tokenizer",
                         value=row, fix="use a chat template that writes the processor's image token once per "
                                        "image content part")
    grids = []
    for data in images:
        grids.append(image_grid(open_rgb(data, spec, row=row), spec))
    id_parts, mask_parts, last = [], [], 0
    for pos, grid in zip(where, grids):
        id_parts.append(base.ids[last:pos])
        mask_parts.append(base.mask[last:pos])
        n = spec.placeholders(grid)
        block = np.concatenate([[ids.start], np.full(n, ids.patch), [ids.end]]).astype(np.int32)
        id_parts.append(block)
        mask_parts.append(np.zeros(block.shape[0], np.uint8))  # media tokens never carry loss
        last = int(pos) + 1
    id_parts.append(base.ids[last:])
    mask_parts.append(base.mask[last:])
    return MediaTokenized(ids=np.concatenate(id_parts).astype(np.int32), mask=np.concatenate(mask_parts),
                          images=tuple(images), grids=tuple(grids))


@dataclass
class ImageRecord:
    record: dict[str, Any]
    base: Path | None  # the folder a relative image path is taken from
    row: str


def load_image_records(data) -> tuple[list[ImageRecord], str]:
    """The rows of ``data`` (local files through their reader, a dataset through ``datasets``),
    each with where its relative image paths start and a name for errors."""
    from muse_stack.data.sources import _read_file, _slice, load_hub, resolve_path

    out: list[ImageRecord] = []
    if data.files:
        for text in data.files:
            path = resolve_path(text)
            if not path.is_file():
                raise InputError("a data file does not exist", field="data.files", value=text,
                                 fix="give existing parquet/jsonl files with CORD-v2's columns (image, ground_truth)")
            for i, rec in enumerate(_read_file(path)):
                name = f"row {i}" + (f" (id {rec['id']})" if isinstance(rec.get("id"), str) else "") + f" of {text}"
                out.append(ImageRecord(rec, path.parent, name))
        lo, hi = _slice(len(out), data.split)
        desc = ", ".join(data.files) + (f" [{data.split}]" if data.split else "")
        return out[lo:hi], desc
    source = load_hub(data)
    for i, rec in enumerate(source.records):
        out.append(ImageRecord(rec, None, f"row {i} of {source.description}"))
    return out, source.description


def record_image_bytes(item: ImageRecord, limit: int | None = None) -> bytes:
    """The encoded bytes of a row's image, read no further than ``limit`` (:func:`image_bytes_of`)."""
    value = item.record.get("image")
    if isinstance(value, str) and item.base is not None and not Path(value).is_absolute():
        value = str(item.base / value)
    elif isinstance(value, dict) and not value.get("bytes") and value.get("path") and item.base is not None \
            and not Path(value["path"]).is_absolute():
        value = {**value, "path": str(item.base / value["path"])}
    if value is None:
        raise InputError(f"{item.row}: there is no image column", field="data image", value=item.row,
                         fix="give rows with CORD-v2's columns: image and ground_truth")
    return image_bytes_of(value, row=item.row, limit=limit)


def image_files_fingerprint(data) -> list[dict[str, str]]:
    """sha256 of every image a local file's rows name by path (their bytes key the build cache)."""
    from muse_stack.data.images import MAX_IMAGE_PIXELS, max_image_bytes

    pixels = (data.details or {}).get("max_image_pixels", MAX_IMAGE_PIXELS)  # its range: the data plan's check
    limit = max_image_bytes(pixels if isinstance(pixels, int) and not isinstance(pixels, bool) and pixels > 0
                            else MAX_IMAGE_PIXELS)
    records, _ = load_image_records(data)
    out = []
    for item in records:
        value = item.record.get("image")
        if isinstance(value, str) or (isinstance(value, dict) and not value.get("bytes")):
            out.append({"row": item.row, "sha256": hashlib.sha256(record_image_bytes(item, limit)).hexdigest()})
    return out


def media_batch(images: list[bytes], grids: np.ndarray, spec: ImageSpec) -> dict[str, Any]:
    """``pixel_values`` [patches, patch_dim] and ``image_grid_thw`` [images, 3] of a micro-batch's
    images in placeholder order."""
    import torch

    values = []
    for k, data in enumerate(images):
        grid = tuple(int(x) for x in grids[k])
        image = open_rgb(data, spec, row=f"image {k} of the batch")
        if image_grid(image, spec) != grid:
            raise InputError(f"image {k} of the batch does not give the grid the build recorded {grid}",
                             field="rows.parquet", value=grid, fix="the build is corrupt; build it again with --force")
        values.append(pixel_values(image, grid, spec))
    return {"pixel_values": torch.cat(values, dim=0),
            "image_grid_thw": torch.as_tensor(np.asarray(grids, dtype=np.int64).reshape(-1, 3))}
