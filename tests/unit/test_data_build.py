"""Build, cache, interruption, CLI, batches and the synthetic builder."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import muse_stack.data.build as build_mod
from muse_stack.cli import main
from muse_stack.data.build import BuiltData, build_for_recipe
from muse_stack.util.errors import InputError
from muse_stack.recipes.catalogue import parse_recipe

ROOT = Path(__file__).resolve().parents[2]


def _data(builder="packed", **data):
    return {"kind": "sft", "builder": builder, "files": [str(ROOT / "data" / "tiny-chat.jsonl")],
            "tokenizer": str(ROOT / "data" / "tiny-tokenizer"), "seed": 1234, **data}


def _recipe_dict(data=None, batch=None, **top):
    return {"name": "tiny-data", "task": "sft", "engine": "reference",
            "hardware": {"gpu": "cpu", "count": 1, "per_node": 1},
            "batch": batch or {"mbs": 4, "gbs": 8, "seq_length": 128}, "training": {"steps": 4},
            "data": data or _data(), "provenance": {"source": "test"}, **top}


def _recipe(**kw):
    return parse_recipe(_recipe_dict(**kw), "test")


def test_cache_hit_and_key(tmp_path):
    a = build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False)
    b = build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False)
    assert a.path == b.path and a.rows_sha256 == b.rows_sha256
    assert b.meta["inputs"]["source"]["files"][0]["name"] == "tiny-chat.jsonl"
    c = build_for_recipe(_recipe(data=_data(seed=5)), cache_dir=tmp_path, progress=False)
    assert c.path != a.path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.path.name, c.path.name])


def test_interrupted_build_leaves_no_output_and_restarts(tmp_path, monkeypatch):
    real = build_mod.write_parquet

    def boom(rows, path, chunk_rows=256, on_chunk=None):
        def chunk(done):
            raise KeyboardInterrupt  # interrupted after the first row group is on disk
        real(rows, path, chunk_rows=8, on_chunk=chunk)

    monkeypatch.setattr(build_mod, "write_parquet", boom)
    with pytest.raises(KeyboardInterrupt):
        build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
    # a build killed outright leaves its temporary directory; the next build removes it
    monkeypatch.setattr(build_mod, "write_parquet", real)
    built = build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False)
    stale = tmp_path / f".{built.path.name}.tmp-999999999"
    stale.mkdir()
    (stale / "rows.parquet").write_bytes(b"partial")
    again = build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False, force=True)
    assert not stale.exists() and again.rows_sha256 == built.rows_sha256
    assert [p.name for p in tmp_path.iterdir()] == [built.path.name]


def test_missing_files_error_names_field(tmp_path):
    with pytest.raises(InputError) as exc:
        build_for_recipe(_recipe(data=_data(files=["no/such.jsonl"])), cache_dir=tmp_path, progress=False)
    assert exc.value.field == "data.files"


def test_missing_hub_dataset_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("MUSE_STACK_DATA_DOWNLOAD", raising=False)
    data = _data(files=None, dataset="allenai/tulu-3-sft-mixture",
                 revision="b14afda60f1bbebe55d5d2fa1e4df5042f97f8be", split="train[:100]")
    with pytest.raises(InputError) as exc:
        build_for_recipe(_recipe(data=data), cache_dir=tmp_path / "c", progress=False)
    assert exc.value.field == "data.dataset"
    assert "data.files" in exc.value.fix and "HF_HOME" in exc.value.fix
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_cli_build_and_missing_source_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_recipe_dict()))
    out = tmp_path / "out"
    assert main(["data", "build", str(good), "--cache", str(tmp_path / "c"), "--out", str(out), "--json"]) == 0
    built = BuiltData.open(out)
    assert built.num_rows > 0 and len(built.rows_sha256) == 64
    assert main(["data", "show", str(good), "--cache", str(tmp_path / "c")]) == 0
    assert "rows_sha256" in capsys.readouterr().out
    rc = main(["data", "build", str(good), "data.files=[missing.jsonl]", "--cache", str(tmp_path / "c")])
    assert rc == 3
    proc = subprocess.run([sys.executable, "-m", "muse_stack.cli", "data", "build", str(good),
                           "data.files=[missing.jsonl]", "--cache", str(tmp_path / "c")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "data.files" in proc.stderr


def test_batches_shapes_labels_and_disjoint_ranks(tmp_path):
    built = build_for_recipe(_recipe(), cache_dir=tmp_path, progress=False)
    rows = built.rows()
    b = next(iter(built.batches(micro_batch_size=3, seed=1)))
    assert b["input_ids"].shape == (3, 128) and b["input_ids"].dtype == torch.long
    for k in ("labels", "loss_mask", "position_ids", "segment_ids"):
        assert b[k].shape == (3, 128)
    sup = b["loss_mask"] > 0
    assert torch.equal(b["labels"][:, :-1][sup[:, :-1]], b["input_ids"][:, 1:][sup[:, :-1]])
    assert (b["labels"][~sup] == -100).all() and not sup[:, -1].any()
    assert b["cu_seqlens_padded"][-1] == 3 * 128
    # positions restart at each sequence start given by cu_seqlens_padded
    flat_pos = b["position_ids"].reshape(-1)
    starts = b["cu_seqlens_padded"][:-1].long()
    assert (flat_pos[starts] == 0).all() and int((flat_pos == 0).sum()) == len(starts)
    # supervised labels never cross a sequence boundary
    seg = b["segment_ids"]
    assert (seg[:, 1:][sup[:, :-1]] == seg[:, :-1][sup[:, :-1]]).all()

    def epoch_rows(rank, world):
        got = []
        for batch in built.batches(micro_batch_size=2, seed=3, rank=rank, world_size=world):
            got += [tuple(r.tolist()) for r in batch["input_ids"]]
        return got

    r0, r1 = epoch_rows(0, 2), epoch_rows(1, 2)
    assert len(r0) == len(r1) == (rows.num_rows // 4) * 2
    all_rows = [tuple(r.tolist()) for r in torch.from_numpy(rows.ids).long()]
    idx = lambda got: {all_rows.index(x) for x in got}  # noqa: E731
    assert not idx(r0) & idx(r1)
    assert epoch_rows(0, 2) == r0  # deterministic
    assert [x["input_ids"] for x in built.batches(2, seed=4)][0].tolist() != \
        [x["input_ids"] for x in built.batches(2, seed=3)][0].tolist()


def test_synthetic_builder_is_deterministic(tmp_path):
    data = {"kind": "synthetic", "builder": "synthetic", "seed": 9}
    r = _recipe(data=data, batch={"mbs": 2, "gbs": 4, "seq_length": 32},
                model={"overrides": {"vocab_size": 512}})
    a = build_for_recipe(r, cache_dir=tmp_path / "a", progress=False)
    b = build_for_recipe(r, cache_dir=tmp_path / "b", progress=False)
    assert a.rows_sha256 == b.rows_sha256 and a.num_rows == 16
    ids = a.rows().ids
    assert ids.shape == (16, 32) and ids.max() < 512 and ids.min() >= 1
    assert a.rows().mask.all()
    c = build_for_recipe(_recipe(data={**data, "seed": 10}, batch={"mbs": 2, "gbs": 4, "seq_length": 32},
                                 model={"overrides": {"vocab_size": 512}}), cache_dir=tmp_path / "a", progress=False)
    assert c.rows_sha256 != a.rows_sha256


def test_dataset_folder_through_datasets_library(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_bytes((ROOT / "data" / "tiny-chat.jsonl").read_bytes())
    data = _data(files=None, dataset=str(folder), split="train[:40]")
    built = build_for_recipe(_recipe(data=data), cache_dir=tmp_path / "c", progress=False)
    assert built.stats["conversations"] == 40
    files = _data(split="train[:40]")
    assert build_for_recipe(_recipe(data=files), cache_dir=tmp_path / "c", progress=False).rows_sha256 == \
        built.rows_sha256


def test_data_show_works_without_the_tokenizer(tmp_path, monkeypatch, capsys):
    # an empty Hugging Face cache: sft-192's tokenizer cannot be found; show still works and marks
    # the token-dependent fields unknown, while build still refuses with the fix
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["data", "show", "sft-192", "--cache", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    for field in ("vocab_size", "eos_id", "pad_id", "cache_key", "tokenizer"):
        assert re.search(rf"{field}\s*│ unknown \(no tokenizer\)", out), field
    assert "row_tokens" in out and "4096" in out and "tokenizer not found" in out
    assert main(["data", "build", "sft-192", "--cache", str(tmp_path / "c")]) == 3
    assert "data.tokenizer" in capsys.readouterr().err
