"""Images to ``pixel_values`` exactly as transformers' image processor for Muse Spark makes them.

transformers 5.24.0 maps ``muse_spark`` to ``MuseGlimmerImageProcessor``
(``models/auto/image_processing_auto.py``; the class is in
``models/muse_glimmer/image_processing_muse_glimmer.py``). Its steps, written here with PIL and
torch (no torchvision):

1. **RGB**: an image with transparency is composited onto white, anything else converted to RGB
   (``image_transforms.convert_to_rgb``).
2. **Resize** with LANCZOS to ``(rows * 28, cols * 28)`` pixels, 28 = patch 14 x merge 2:
   :func:`smart_resize` picks the integer grid of 28-pixel cells nearest the image's aspect ratio
   with at most ``max_image_tokens`` (4096) cells, i.e. merged tokens. transformers' torchvision
   backend runs LANCZOS only on torchvision >= 0.27 on a CPU (else it falls back to BICUBIC and
   warns that only PIL's LANCZOS matches the original model); this is PIL's LANCZOS on the uint8
   RGB image, the resampling the warning names as the reference.
3. **Rescale and normalise**, fused as transformers fuses them (``_fuse_mean_std_and_rescale_factor``):
   mean and std 0.5 divided by the rescale factor 1/255 give 127.5 and 127.5, so each value is
   ``(x - 127.5) / 127.5`` in float32 (one rounding: ``x - 127.5`` is exact).
4. **Patchify**: the [3, H, W] image becomes ``(H/14) * (W/14)`` rows in raster order, each the
   (temporal, channel, row, column) flattening of its 14 x 14 patch repeated over the 2 frames of
   a temporal patch: 2 * 3 * 14 * 14 = 1176 values. ``image_grid_thw`` is ``[1, H/14, W/14]``, and
   the text holds ``H/14 * W/14 / 4`` image placeholders for it.
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass

import numpy as np

from muse_stack.util.errors import InputError
from muse_stack.models.muse_spark.tower_config import MAX_IMAGE_TOKENS

#: transformers' MuseGlimmerImageProcessor class defaults
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
IMAGE_MEAN = 0.5
IMAGE_STD = 0.5
RESCALE_FACTOR = 1 / 255
#: pixels beyond which an image is refused as oversized: PIL's own decompression-bomb limit
MAX_IMAGE_PIXELS = 89_478_485
#: the widest pixel an encoded image stores uncompressed (RGBA at 16 bits a channel) and room for the
#: metadata blocks beside the pixels (EXIF segments, ICC profiles, text chunks): an image file larger than
#: ``max_image_bytes`` of the pixel limit cannot be one the build would accept, and is not read past it
WIDEST_PIXEL_BYTES = 8
METADATA_BYTES = 16 << 20


def max_image_bytes(max_image_pixels: int = MAX_IMAGE_PIXELS) -> int:
    """The most bytes an encoded image of at most ``max_image_pixels`` pixels can take."""
    return WIDEST_PIXEL_BYTES * max_image_pixels + METADATA_BYTES


@dataclass(frozen=True)
class ImageSpec:
    """The processor settings one build uses (transformers' defaults unless the recipe's model
    says otherwise: the patch, temporal patch and merge sizes come from the vision tower)."""

    patch_size: int = PATCH_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    merge_size: int = MERGE_SIZE
    max_image_tokens: int = MAX_IMAGE_TOKENS
    max_image_pixels: int = MAX_IMAGE_PIXELS

    @property
    def max_image_bytes(self) -> int:
        return max_image_bytes(self.max_image_pixels)

    @property
    def patch_dim(self) -> int:
        return self.temporal_patch_size * 3 * self.patch_size**2

    def placeholders(self, grid: tuple[int, int, int]) -> int:
        """Image placeholder tokens for a ``(t, h, w)`` grid: t * h * w / merge^2."""
        t, h, w = grid
        return t * h * w // self.merge_size**2


def smart_resize(height: int, width: int, patch_size: int, max_tokens: int) -> tuple[int, int]:
    """The resize target ``(height, width)`` in pixels: the integer grid of ``patch_size`` cells
    nearest the aspect ratio ``height / width`` with at most ``max_tokens`` cells (the same math
    as transformers' ``smart_resize`` of muse_glimmer, which ``patch_size = patch * merge`` calls)."""
    ideal_h = height / patch_size
    ideal_w = width / patch_size
    ratio = ideal_w / ideal_h if ideal_h > 0 else 1.0
    if ideal_h * ideal_w > max_tokens:
        ideal_h = (max_tokens / ratio) ** 0.5
        ideal_w = ideal_h * ratio
    # a list made from a set, as transformers makes it: int tuples hash the same on every run, so
    # the order (and with it the choice among equally near grids) is the same as transformers'
    candidates = list(set(itertools.product([math.floor(ideal_h), math.ceil(ideal_h)],
                                            [math.floor(ideal_w), math.ceil(ideal_w)])))
    fitting = [(h, w) for h, w in candidates if h >= 1 and w >= 1 and h * w <= max_tokens]
    if not fitting:
        fitting = [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    best = min(fitting, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return best[0] * patch_size, best[1] * patch_size


def image_bytes_of(value, *, row: str, limit: int | None = None) -> bytes:
    """The encoded bytes of an ``image`` column value: a ``datasets`` Image dict (``bytes`` or
    ``path``), a path string, or raw bytes. A missing file, ``bytes`` that are not bytes (text, a
    number) and an image larger than ``limit`` bytes (default: :func:`max_image_bytes`; a file is not
    read past it) are InputErrors naming ``row``."""
    from muse_stack.util.safeio import read_bytes

    limit = max_image_bytes() if limit is None else limit
    path, data = None, None
    if isinstance(value, dict):
        raw = value.get("bytes")
        if raw is not None and not isinstance(raw, (bytes, bytearray, memoryview)):
            raise InputError(f"{row}: the image column's bytes hold a {type(raw).__name__}, not the encoded image's "
                             "bytes", field="data image", value=row,
                             fix="store the encoded image (PNG, JPEG, ...) as binary bytes, as datasets' Image "
                                 "feature does, or give the image file under path")
        if raw:
            data = bytes(raw)
        else:
            path = value.get("path")
    elif isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif isinstance(value, str):
        path = value
    if data is not None:
        if len(data) > limit:
            raise InputError(f"{row}: the image is {len(data):,} bytes, more than an image within the pixel limit "
                             f"can take ({limit:,})", field="data image", value=row,
                             fix="downscale or drop the image, or raise data.details.max_image_pixels")
        return data
    if not path or not isinstance(path, str):
        raise InputError(f"{row}: the image column holds no image (neither bytes nor a path)", field="data image",
                         value=row, fix="give each row an image: encoded bytes or the path of an image file")
    try:
        return read_bytes(path, field="data image", what="image file", limit=limit,
                          fix="downscale or drop the image, or raise data.details.max_image_pixels")
    except InputError as exc:
        if exc.rule is not None:  # too large: a file is read no further than the limit
            raise InputError(f"{row}: the image file {path} {exc.message.split(' ', 1)[1]}", field="data image",
                             value=str(path), rule=exc.rule, fix=exc.fix) from exc
        raise InputError(f"{row}: the image file {path} cannot be read ({exc.message})", field="data image",
                         value=str(path), fix="restore the file, or drop the row from the data") from exc


def open_rgb(data: bytes, spec: ImageSpec, *, row: str):
    """The decoded image in RGB (transparency composited onto white, as transformers'
    ``convert_to_rgb``). A corrupt or oversized image is an InputError naming ``row``."""
    import warnings

    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS  # PIL's own bomb check follows the build's limit while it decodes
    Image.MAX_IMAGE_PIXELS = spec.max_image_pixels
    try:
        with warnings.catch_warnings():
            # past the limit the check below says so by size; past twice it, PIL refuses to decode
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > spec.max_image_pixels:
                raise InputError(f"{row}: the image is {width} x {height} pixels, more than the "
                                 f"{spec.max_image_pixels:,} an image may have", field="data image", value=row,
                                 fix="downscale or drop the image (the processor would shrink it to at most "
                                     f"{spec.max_image_tokens} merged tokens anyway), or raise "
                                     "data.details.max_image_pixels")
            image.load()
    except InputError:
        raise
    except Image.DecompressionBombError as exc:
        raise InputError(f"{row}: the image is oversized ({exc})", field="data image", value=row,
                         fix="downscale or drop the image, or raise data.details.max_image_pixels") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's errors for an unreadable or truncated image
        raise InputError(f"{row}: the image cannot be decoded ({type(exc).__name__}: {exc})", field="data image",
                         value=row, fix="replace the corrupt image file, or drop the row from the data") from exc
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def image_grid(image, spec: ImageSpec) -> tuple[int, int, int]:
    """``(t, h, w)`` in patches of the processed image (t is 1 for an image)."""
    width, height = image.size
    h, w = smart_resize(height, width, spec.patch_size * spec.merge_size, spec.max_image_tokens)
    return 1, h // spec.patch_size, w // spec.patch_size


def pixel_values(image, grid: tuple[int, int, int], spec: ImageSpec):
    """``pixel_values`` [h * w, patch_dim] float32 of an RGB image for its ``grid``."""
    import torch
    from PIL import Image

    _, gh, gw = grid
    p = spec.patch_size
    resized = image.resize((gw * p, gh * p), resample=Image.Resampling.LANCZOS)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy()).permute(2, 0, 1)  # [3, H, W] uint8
    scale = IMAGE_MEAN / RESCALE_FACTOR  # 127.5: mean and std (both 0.5) fused with 1/255
    values = (pixels.to(torch.float32) - scale) / (IMAGE_STD / RESCALE_FACTOR)
    return patchify(values.unsqueeze(0), p, spec.temporal_patch_size)[0]


def patchify(images, patch_size: int, temporal_patch_size: int):
    """[B, C, H, W] -> [B, (H/p) * (W/p), T * C * p * p]: patches in raster order, each flattened
    as (temporal, channel, row, column) with the frame repeated T times."""
    b, c, height, width = images.shape
    gh, gw = height // patch_size, width // patch_size
    patches = images.reshape(b, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 1, 3, 5)
    return (patches.unsqueeze(3).expand(-1, -1, -1, temporal_patch_size, -1, -1, -1)
            .reshape(b, gh * gw, temporal_patch_size * c * patch_size * patch_size))
