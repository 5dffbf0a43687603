"""Image-text rows: transformers' image processor math, the media token layout, the loss policy,
the rows hash over the images, and clear errors for bad images."""

from __future__ import annotations

import ast
import importlib.util
import io
import itertools
import json
import math
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from muse_stack.data.build import build_for_recipe, plan_for_recipe
from muse_stack.data.chat import ChatTokenizer
from muse_stack.data.images import ImageSpec, image_grid, open_rgb, patchify, pixel_values, smart_resize
from muse_stack.data.multimodal import json2token
from muse_stack.data.rows import read_parquet, rows_sha256
from muse_stack.util.errors import InputError, RecipeError
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
GLIMMER = Path(importlib.util.find_spec("transformers").submodule_search_locations[0]) / "models" / "muse_glimmer" \
    / "image_processing_muse_glimmer.py"


def transformers_def(name: str):
    """A function (or method, as a plain function) from transformers' muse_glimmer image processor,
    compiled from its installed source: the module itself imports torchvision, which is not here."""
    text = GLIMMER.read_text(encoding="utf-8")
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"itertools": itertools, "math": math, "torch": torch}
    exec(compile(textwrap.dedent(ast.get_source_segment(text, node)), str(GLIMMER), "exec"), namespace)
    return namespace[name]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6000), st.integers(1, 6000), st.sampled_from([4, 16, 64, 4096]))
def test_smart_resize_is_transformers_own(height, width, max_tokens):
    theirs = transformers_def("smart_resize")
    assert smart_resize(height, width, 28, max_tokens) == theirs(height=height, width=width, patch_size=28,
                                                                 max_tokens=max_tokens)
    h, w = smart_resize(height, width, 28, max_tokens)
    # whole 28-pixel cells; the cap holds except in transformers' fallback for aspect ratios so
    # extreme that no floor/ceil grid of at least 1 x 1 fits (it then rounds, as here)
    assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28


def test_patchify_is_transformers_own():
    images = torch.randn(2, 3, 28 * 2, 28 * 3, generator=torch.Generator().manual_seed(0))
    theirs, gh, gw = transformers_def("patchify")(None, images, patch_size=14, temporal_patch_size=2)
    assert (gh, gw) == (4, 6)
    assert torch.equal(patchify(images, 14, 2), theirs)
    # a control: the (channel, temporal) order Glm4v uses is a different layout
    wrong = images.reshape(2, 3, 4, 14, 6, 14).permute(0, 2, 4, 1, 3, 5).unsqueeze(4)
    wrong = wrong.expand(-1, -1, -1, -1, 2, -1, -1).reshape(2, 24, 1176)
    assert not torch.equal(patchify(images, 14, 2), wrong)


@pytest.mark.parametrize("mode, size", [("RGB", (131, 97)), ("RGBA", (60, 200)), ("L", (500, 300)),
                                        ("P", (3000, 2000))])
def test_pixel_values_are_transformers_processor_output(mode, size):
    """RGB conversion, the LANCZOS resize, the fused rescale-normalise and the patch layout, each
    against transformers' own code (its PIL resize, its fused mean and std, its patchify): equal
    to the bit, so no tolerance."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_transforms import convert_to_rgb, resize
    from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling

    rng = np.random.RandomState(sum(size))
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "P": 1}[mode]
    array = rng.randint(0, 256, size=(size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode="L" if mode == "P" else mode)
    if mode == "P":
        image = image.convert("P")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    spec = ImageSpec()
    rgb = open_rgb(buf.getvalue(), spec, row="test")
    grid = image_grid(rgb, spec)
    ours = pixel_values(rgb, grid, spec)

    their_rgb = convert_to_rgb(Image.open(io.BytesIO(buf.getvalue())), return_numpy=True)
    h, w = transformers_def("smart_resize")(height=size[1], width=size[0], patch_size=28, max_tokens=4096)
    assert grid == (1, h // 14, w // 14)
    resized = resize(their_rgb, (h, w), resample=PILImageResampling.LANCZOS)
    mean, std, rescale = TorchvisionBackend._fuse_mean_std_and_rescale_factor.__wrapped__(
        None, do_normalize=True, image_mean=tuple(IMAGENET_STANDARD_MEAN), image_std=tuple(IMAGENET_STANDARD_STD),
        do_rescale=True, rescale_factor=1 / 255)
    assert rescale is False
    chw = torch.from_numpy(np.ascontiguousarray(resized)).permute(2, 0, 1).to(torch.float32)
    normed = (chw - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)  # torchvision's normalize: sub_(mean).div_(std)
    theirs, _, _ = transformers_def("patchify")(None, normed.unsqueeze(0), patch_size=14, temporal_patch_size=2)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs[0])
    # a control: rescaling then normalising unfused rounds differently somewhere
    unfused = (chw * (1 / 255) - 0.5) / 0.5
    assert not torch.equal(patchify(unfused.unsqueeze(0), 14, 2)[0], ours) or size == (131, 97)


def test_json2token_writes_donut_tags_as_megatron_bridge():
    parse = {"menu": [{"nm": "TEA", "cnt": "1"}, {"nm": "BUN", "cnt": "2"}], "total": {"total_price": "5.00"}}
    assert json2token(parse) == ("<s_total><s_total_price>5.00</s_total_price></s_total>"
                                 "<s_menu><s_nm>TEA</s_nm><s_cnt>1</s_cnt><sep/>"
                                 "<s_nm>BUN</s_nm><s_cnt>2</s_cnt></s_menu>")
    assert json2token({"text_sequence": "plain"}) == "plain"


def _fixture(tmp_path: Path, count: int = 6) -> Path:
    """The first ``count`` shipped receipts, copied (rows and image files) into ``tmp_path``."""
    (tmp_path / "tiny-receipts").mkdir()
    lines = (ROOT / "data" / "tiny-receipts.jsonl").read_text(encoding="utf-8").splitlines()[:count]
    for line in lines:
        name = json.loads(line)["image"]
        shutil.copy(ROOT / "data" / name, tmp_path / name)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _recipe(rows: Path, *extra: str):
    return load_recipe("tiny-cpu-mm", [f"data.files=[{rows}]", "batch.gbs=1", *extra])


def test_the_fixture_builds_with_the_processor_layout_and_the_stated_loss(tmp_path):
    built = build_for_recipe(load_recipe("tiny-cpu-mm"), cache_dir=tmp_path / "cache", progress=False)
    rows = built.rows()
    tok = ChatTokenizer(ROOT / "data" / "tiny-mm-tokenizer")
    patch, start, end = (tok.tokenizer.token_to_id(t) for t in ("<|patch|>", "<|image_start|>", "<|image_end|>"))
    assert patch == load_recipe("tiny-cpu-mm").towers_config_resolved().image_token_id
    assert built.stats["images"] == built.stats["kept_conversations"] == 64
    docs = " ".join((ROOT / "docs" / "data.md").read_text().split())
    assert f"into {built.stats['packs']} rows of 512 tokens, {built.stats['image_tokens']:,} of them image" in docs
    for r in range(rows.num_rows):
        ids, mask = rows.ids[r], rows.mask[r]
        starts, ends = np.flatnonzero(ids == start), np.flatnonzero(ids == end)
        assert len(starts) == len(ends) == len(rows.images[r]) == len(rows.image_grids[r])
        for s, e, grid in zip(starts, ends, rows.image_grids[r]):
            # <|image_start|> + <|patch|> x t*h*w/4 + <|image_end|>, nothing else between
            assert e - s - 1 == int(np.prod(grid)) // 4 and (ids[s + 1:e] == patch).all()
        media = np.isin(ids, [patch, start, end])
        assert not mask[media].any()  # media tokens never carry loss
        supervised = tok.tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        assert "<s_total_price>" in supervised and "Describe this image" not in supervised
    # the pixels of a batch: one row per patch of its images, in placeholder order
    batch = next(iter(built.batches(1, seed=None)))
    grids = batch["image_grid_thw"]
    assert batch["pixel_values"].shape == (int(grids.prod(dim=1).sum()), 1176)
    assert int((batch["input_ids"] == patch).sum()) == int(grids.prod(dim=1).sum()) // 4
    again = read_parquet(built.parquet)
    assert rows_sha256(again) == built.rows_sha256 and again.images == rows.images


def test_the_rows_hash_covers_the_image_bytes(tmp_path):
    rows = _fixture(tmp_path)
    first = build_for_recipe(_recipe(rows), cache_dir=tmp_path / "cache", progress=False)
    image_path = tmp_path / json.loads(rows.read_text().splitlines()[2])["image"]
    image = Image.open(image_path).convert("RGB")
    image.putpixel((50, 60), (255, 0, 0))  # the same size and grid, so the same token ids
    image.save(image_path, format="PNG")
    second = build_for_recipe(_recipe(rows), cache_dir=tmp_path / "cache", progress=False)
    assert second.path != first.path  # the image's bytes key the cache
    assert np.array_equal(first.rows().ids, second.rows().ids)
    assert second.rows_sha256 != first.rows_sha256


@pytest.mark.parametrize("damage, words", [
    ("corrupt", "cannot be decoded"),
    ("missing", "cannot be read"),
    ("oversized", "200 x 200 pixels, more than the 30,000"),
])
def test_a_bad_image_is_an_input_error_naming_its_row(tmp_path, damage, words):
    rows = _fixture(tmp_path)
    record = json.loads(rows.read_text().splitlines()[3])
    image_path = tmp_path / record["image"]
    extra = []
    if damage == "corrupt":
        image_path.write_bytes(image_path.read_bytes()[:60])
    elif damage == "missing":
        image_path.unlink()
    else:
        extra = ["data.details.max_image_pixels=30000"]  # the shipped receipts have at most 23,520
        Image.new("RGB", (200, 200), (255, 255, 255)).save(image_path, format="PNG")
    with pytest.raises(InputError) as exc:
        build_for_recipe(_recipe(rows, *extra), cache_dir=tmp_path / "cache", progress=False)
    assert f"row 3 (id {record['id']})" in exc.value.message and words in exc.value.message and exc.value.fix
    assert not any((tmp_path / "cache").glob("*/rows.parquet"))  # nothing half-built is left


@pytest.mark.parametrize("image, words", [
    ("/dev/zero", "holds more than"),  # a device: size 0 to stat, and no end
    ({"path": "/dev/zero"}, "holds more than"),
    ({"bytes": "iVBORw0KGgo=", "path": None}, "bytes hold a str"),  # base64 text, not the image's bytes
    ({"bytes": 12}, "bytes hold a int"),
])
def test_an_unbounded_or_mistyped_image_is_an_input_error_naming_its_row(tmp_path, image, words):
    """An image is read no further than the most an image within the pixel limit can take
    (data.details.max_image_pixels=30000: 8 bytes a pixel and 16 MiB of metadata, about 16.2 MB),
    and image bytes that are not bytes are refused by row; neither is an internal error."""
    rows = _fixture(tmp_path, 3)
    lines = rows.read_text().splitlines()
    record = json.loads(lines[1])
    record["image"] = image
    lines[1] = json.dumps(record)
    rows.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as exc:
        build_for_recipe(_recipe(rows, "data.details.max_image_pixels=30000"), cache_dir=tmp_path / "cache",
                         progress=False)
    assert f"row 1 (id {record['id']})" in exc.value.message and words in exc.value.message and exc.value.fix


def test_an_image_file_is_read_no_further_than_its_limit():
    from muse_stack.data.images import image_bytes_of, max_image_bytes

    with pytest.raises(InputError, match="more than 1,000 bytes"):
        image_bytes_of("/dev/zero", row="row 1", limit=1000)
    assert ImageSpec(max_image_pixels=30_000).max_image_bytes == max_image_bytes(30_000) == 8 * 30_000 + (16 << 20)


def test_the_builds_pixel_limit_governs_not_pils_global_one(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL's process-wide limit, lowered
    buf = io.BytesIO()
    Image.new("RGB", (100, 100)).save(buf, format="PNG")  # 10,000 pixels: past twice PIL's limit
    assert open_rgb(buf.getvalue(), ImageSpec(max_image_pixels=50_000), row="r").size == (100, 100)
    with pytest.raises(InputError, match="100 x 100 pixels, more than the 6,000"):
        open_rgb(buf.getvalue(), ImageSpec(max_image_pixels=6_000), row="r")
    with pytest.raises(InputError, match="oversized"):  # past twice the build's limit PIL refuses to decode
        open_rgb(buf.getvalue(), ImageSpec(max_image_pixels=4_000), row="r")
    assert Image.MAX_IMAGE_PIXELS == 1000  # left as it was


def test_image_text_plans_refuse_what_would_cut_or_misplace_an_image(tmp_path):
    rows = _fixture(tmp_path, 2)
    for extra, field in ((["data.builder=fixed"], "data.builder"),
                         (["data.details.overlong=truncate"], "data.details.overlong"),
                         (["data.details.max_image_tokens=0"], "data.details.max_image_tokens")):
        with pytest.raises(RecipeError) as exc:
            plan_for_recipe(_recipe(rows, *extra))
        assert exc.value.field == field
    recipe = _recipe(rows)
    recipe.model.towers["image_token_id"] = 514  # the tokenizer's <|image_end|>, not its placeholder
    with pytest.raises(RecipeError) as exc:
        build_for_recipe(recipe, cache_dir=tmp_path / "c", progress=False)
    assert exc.value.field == "model.towers.image_token_id" and "513" in exc.value.fix


def test_a_template_without_the_image_token_is_refused_naming_the_row(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(ROOT / "data" / "tiny-mm-tokenizer", tok)
    template = (tok / "chat_template.jinja").read_text().replace("<|patch|>", "")
    (tok / "chat_template.jinja").write_text(template)
    rows = _fixture(tmp_path, 2)
    with pytest.raises(InputError) as exc:
        build_for_recipe(_recipe(rows, f"data.tokenizer={tok}"), cache_dir=tmp_path / "c", progress=False)
    assert "row 0 (id receipt-0000)" in exc.value.message and "0 image token" in exc.value.message


def test_the_fixture_script_writes_the_shipped_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny_receipts", ROOT / "data" / "make_tiny_receipts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_receipts(tmp_path / "tiny-receipts.jsonl", tmp_path / "tiny-receipts")
    assert (tmp_path / "tiny-receipts.jsonl").read_bytes() == (ROOT / "data" / "tiny-receipts.jsonl").read_bytes()
    module.write_tokenizer(ROOT / "data" / "tiny-tokenizer", tmp_path / "tok")
    for name in ("tokenizer.json", "chat_template.jinja", "tokenizer_config.json"):
        assert (tmp_path / "tok" / name).read_bytes() == (ROOT / "data" / "tiny-mm-tokenizer" / name).read_bytes()


def test_a_dataset_read_through_datasets_gives_the_rows_of_the_same_files(tmp_path):
    """CORD-v2's form: a ``datasets`` dataset with an Image column (here a local parquet folder,
    read by ``datasets.load_dataset`` as the hub's copy is) builds the rows the JSONL and image
    files build: the same tokens, masks, images and hash."""
    import datasets

    rows = _fixture(tmp_path, 4)
    records = [json.loads(line) for line in rows.read_text().splitlines()]
    table = datasets.Dataset.from_dict({
        "image": [{"bytes": (tmp_path / r["image"]).read_bytes(), "path": None} for r in records],
        "ground_truth": [r["ground_truth"] for r in records]}).cast_column("image", datasets.Image())
    folder = tmp_path / "cord"
    folder.mkdir()
    table.to_parquet(str(folder / "train.parquet"))
    files = build_for_recipe(_recipe(rows), cache_dir=tmp_path / "a", progress=False)
    hub = build_for_recipe(_recipe(rows, "data.files=null", f"data.dataset={folder}"), cache_dir=tmp_path / "b",
                           progress=False)
    assert hub.rows_sha256 == files.rows_sha256 and hub.rows().images == files.rows().images


def test_the_seed_recipes_plan_packed_image_text_rows_with_the_released_ids():
    plan = plan_for_recipe(load_recipe("sft-192-mm", ["batch.seq_length=4096"]), require_tokenizer=False)
    assert plan.builder == "packed" and plan.row_tokens == 4096
    assert plan.image == {"prompt": "Describe this image.", "patch_size": 14, "temporal_patch_size": 2,
                          "merge_size": 2, "max_image_tokens": 4096, "max_image_pixels": 89_478_485,
                          "image_token_id": 200092}


def test_the_expansion_in_ids_is_the_processors_expansion_in_text():
    """transformers' MuseSparkProcessor replaces each image token in the rendered text by
    start + image token x n + end (replace_image_token) and then tokenizes; expanding in id space
    gives the same ids."""
    from muse_stack.data.multimodal import cord_messages, media_ids, tokenize_image_text

    tok = ChatTokenizer(ROOT / "data" / "tiny-mm-tokenizer")
    record = json.loads((ROOT / "data" / "tiny-receipts.jsonl").read_text().splitlines()[5])
    image = (ROOT / "data" / record["image"]).read_bytes()
    spec = ImageSpec()
    ours = tokenize_image_text(tok, cord_messages(record, "Describe this image.", "r"), [image],
                               media_ids(tok, 513), spec, "r")
    n = spec.placeholders(ours.grids[0])
    text = tok.render(cord_messages(record, "Describe this image.", "r"))
    assert text.count("<|patch|>") == 1
    expanded = text.replace("<|patch|>", "<|image_start|>" + "<|patch|>" * n + "<|image_end|>")
    assert tok.tokenizer.encode(expanded, add_special_tokens=False).ids == ours.ids.tolist()
