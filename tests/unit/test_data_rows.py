"""Fixed and packed rows on the shipped fixture: golden hashes, determinism, shapes, masks."""

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from muse_stack.data.build import build_for_recipe
from muse_stack.data.chat import ChatTokenizer
from muse_stack.data.rows import read_parquet, row_bytes, rows_sha256
from muse_stack.recipes.catalogue import parse_recipe

ROOT = Path(__file__).resolve().parents[2]

# the rows sha256 of the shipped fixture (data/tiny-chat.jsonl, data/tiny-tokenizer) under _recipe()'s
# settings; a change here means rows differ from every earlier build
GOLDEN = {
    "fixed": "98ae9766519ad1de7820f7c596c940d1cdfe24d819eda2a4d6afeaf80f8387ad",
    "packed": "d30f6b79ece6bd7c2f7128efebdc32a772f7152791b35e9d66ee810252685999",
}


def _recipe(builder="fixed", **data):
    d = {"kind": "sft", "builder": builder, "files": [str(ROOT / "data" / "tiny-chat.jsonl")],
         "tokenizer": str(ROOT / "data" / "tiny-tokenizer"), "seed": 1234,
         "template_kwargs": {"current_date": "2026-10-01"}, **data}
    return parse_recipe({"name": "tiny-data", "task": "sft", "engine": "reference",
                         "hardware": {"gpu": "cpu", "count": 1, "per_node": 1},
                         "batch": {"mbs": 4, "gbs": 8, "seq_length": 96}, "training": {"steps": 4},
                         "data": d, "provenance": {"source": "test"}}, "test")


@pytest.mark.parametrize("builder", ["fixed", "packed"])
def test_golden_rows_hash(builder, tmp_path):
    built = build_for_recipe(_recipe(builder), cache_dir=tmp_path, progress=False)
    assert built.rows_sha256 == GOLDEN[builder]
    again = build_for_recipe(_recipe(builder), cache_dir=tmp_path / "other", progress=False, force=True)
    assert again.rows_sha256 == built.rows_sha256


def test_hash_definition_matches_bytes(tmp_path):
    built = build_for_recipe(_recipe("packed"), cache_dir=tmp_path, progress=False)
    rows = read_parquet(built.parquet)
    h = hashlib.sha256()
    for r in range(rows.num_rows):
        h.update(rows.ids[r].astype("<i4").tobytes())
        h.update(rows.mask[r].astype("u1").tobytes())
        k = len(rows.seq_lengths[r])
        h.update(np.int32(k).astype("<i4").tobytes())
        h.update(rows.seq_lengths[r].astype("<i4").tobytes() + rows.seq_lengths_padded[r].astype("<i4").tobytes())
    assert h.hexdigest() == built.rows_sha256 == rows_sha256(rows)
    fixed = read_parquet(build_for_recipe(_recipe("fixed"), cache_dir=tmp_path, progress=False).parquet)
    assert row_bytes(fixed.ids[0], fixed.mask[0]) == fixed.ids[0].astype("<i4").tobytes() + fixed.mask[0].tobytes()


@pytest.mark.parametrize("builder", ["fixed", "packed"])
def test_seed_and_template_kwargs_change_the_hash(builder, tmp_path):
    base = build_for_recipe(_recipe(builder), cache_dir=tmp_path, progress=False).rows_sha256
    other_seed = build_for_recipe(_recipe(builder, seed=7), cache_dir=tmp_path, progress=False).rows_sha256
    other_kwargs = build_for_recipe(_recipe(builder, template_kwargs={"current_date": "2026-10-02"}),
                                    cache_dir=tmp_path, progress=False).rows_sha256
    assert len({base, other_seed, other_kwargs}) == 3


def _tokenizer_copy(tmp_path, template=None, vocab=None):
    spec = importlib.util.spec_from_file_location("make_tiny_chat", ROOT / "data" / "make_tiny_chat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "tok"
    if vocab:
        mod.VOCAB_SIZE = vocab
    mod.train_tokenizer(mod.conversations(), out)
    if template:
        (out / "chat_template.jinja").write_text(template)
    return out


def test_retraining_the_tokenizer_is_deterministic(tmp_path):
    out = _tokenizer_copy(tmp_path)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (ROOT / "data" / "tiny-tokenizer" / name).read_bytes()


def test_other_tokenizer_or_template_changes_the_hash(tmp_path):
    base = build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False).rows_sha256
    small = _tokenizer_copy(tmp_path / "a", vocab=384)
    tpl = (ROOT / "data" / "tiny-tokenizer" / "chat_template.jinja").read_text().replace("Date: ", "Today: ")
    retemplated = _tokenizer_copy(tmp_path / "b", template=tpl)
    h1 = build_for_recipe(_recipe(tokenizer=str(small)), cache_dir=tmp_path, progress=False).rows_sha256
    h2 = build_for_recipe(_recipe(tokenizer=str(retemplated)), cache_dir=tmp_path, progress=False).rows_sha256
    assert len({base, h1, h2}) == 3


def test_fixed_rows_are_the_permuted_stream(tmp_path):
    recipe = _recipe("fixed")
    built = build_for_recipe(recipe, cache_dir=tmp_path, progress=False)
    rows = built.rows()
    n = 96
    assert rows.ids.shape[1] == n and all(len(r) == n for r in rows.ids)
    tok = ChatTokenizer(ROOT / "data" / "tiny-tokenizer", recipe.data.template_kwargs)
    convs = [json.loads(x) for x in (ROOT / "data" / "tiny-chat.jsonl").read_text().splitlines()]
    perm = np.random.RandomState(1234).permutation(len(convs))
    parts = []
    for j, i in enumerate(perm):
        if j:
            parts.append(np.asarray([tok.eos_id], np.int32))
        parts.append(tok.tokenize(convs[i]["messages"]).ids)
    stream = np.concatenate(parts)
    flat = rows.ids.reshape(-1)
    pad = built.stats["padding_tokens"]
    assert pad == flat.shape[0] - stream.shape[0] and 0 <= pad < n
    assert np.array_equal(flat[: stream.shape[0]], stream)
    assert (flat[stream.shape[0]:] == tok.pad_id).all() and not rows.mask.reshape(-1)[stream.shape[0]:].any()
    assert (rows.mask.sum(axis=1) > 0).all()
    ratio = rows.mask.sum() / rows.mask.size
    # the stats are rounded to 6 decimals (builders._ratio): |error| <= 5e-7 (+ float64 rounding, < 1e-15)
    assert built.stats["supervised_token_ratio"] == pytest.approx(ratio, abs=6e-7)


def test_fixed_row_limit_and_parquet_roundtrip(tmp_path):
    built = build_for_recipe(_recipe("fixed", rows=10), cache_dir=tmp_path, progress=False)
    assert built.num_rows == 10
    rows = read_parquet(built.parquet)
    assert rows.ids.dtype == np.int32 and rows.ids.shape == (10, 96)
    assert rows_sha256(rows) == built.rows_sha256
