"""A file system that refuses a write (full, read-only, a link to nowhere) and an input without an end
are the user's to fix: exit 3 with the path and the fix, nothing half-written left behind, never an
internal error (exit 70). The tests run as root, where a read-only mode stops no write, so a refusing
file system is simulated where the write is made (the errno the kernel gives)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from muse_stack.util import safeio
from muse_stack.util.errors import InputError


def test_a_device_is_read_no_further_than_the_limit():
    """/dev/zero reports size 0 to stat and never ends: it is refused after limit + 1 bytes."""
    with pytest.raises(InputError, match="holds more than 1,000 bytes"):
        safeio.read_text("/dev/zero", field="recipe", what="recipe YAML file", limit=1000)
    with pytest.raises(InputError, match="more than 10 bytes"):
        safeio.read_bytes("/dev/zero", field="x", limit=10)
    with pytest.raises(InputError, match="not a regular file"):
        safeio.read_bytes("/dev/zero", field="x", limit=None)  # no limit: only a file whose size is known
    with pytest.raises(InputError, match="not a regular file"):
        safeio.sha256_file("/dev/zero", field="data.files")


def test_a_recipe_file_that_is_dev_zero_is_refused(cli, tmp_path):
    """A recipe.yaml linked to /dev/zero is read up to the size limit of a recipe (64 MiB), then refused."""
    recipe = tmp_path / "recipe.yaml"
    recipe.symlink_to("/dev/zero")
    rc, _, err = cli("plan", recipe)
    said = " ".join(err.split())
    assert rc == 3 and "recipe.yaml" in said and "too large" in said, err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny run with its final checkpoint."""
    import torch

    from muse_stack.run.pipeline import run

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done = run("tiny-cpu", out=tmp_path_factory.mktemp("run") / "run", steps=1, progress=False,
                   overrides=["training.measure_warmup_steps=0", "batch.gbs=2"])
    finally:
        torch.set_num_threads(before)
    assert done.status == "completed"
    return done.path


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_export_onto_a_dangling_link_is_refused(finished, tmp_path, cli):
    link = tmp_path / "hf"
    link.symlink_to(tmp_path / "nowhere")
    rc, _, err = cli("export", finished, "--hf", link)
    said = " ".join(err.split())
    assert rc == 3 and "--hf" in said and "symbolic link" in said and "nowhere" in said, err
    assert _left(tmp_path) == ["hf"] and not (tmp_path / "nowhere").exists()


def test_export_onto_a_read_only_file_system_is_refused(finished, tmp_path, cli, monkeypatch):
    from muse_stack.util import atomic

    def read_only(target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(Path(target).parent))

    monkeypatch.setattr(atomic, "make_temp_dir", read_only)
    rc, _, err = cli("export", finished, "--hf", tmp_path / "hf")
    said = " ".join(err.split())
    assert rc == 3 and str(tmp_path / "hf") in said and "Read-only file system" in said and "fix:" in said, err
    assert _left(tmp_path) == []


def test_export_onto_a_full_file_system_is_refused_and_leaves_nothing(finished, tmp_path, cli, monkeypatch):
    """The shard writer fails part-way with ENOSPC (as safetensors reports it: its own error naming
    the OS error): exit 3 naming the path, no staging folder left."""
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # part of a shard
        raise RuntimeError(f"Error while serializing: IoError(Os {{ code: {errno.ENOSPC}, kind: StorageFull, "
                           f'message: "{os.strerror(errno.ENOSPC)}" }})')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    rc, _, err = cli("export", finished, "--hf", tmp_path / "hf")
    said = " ".join(err.split())
    assert rc == 3 and "file system is full" in said and str(tmp_path / "hf") in said, err
    assert _left(tmp_path) == []


def test_a_data_build_on_a_full_cache_is_refused_and_leaves_nothing(tmp_path, cli, monkeypatch):
    """pyarrow's writer fails with ENOSPC part-way through rows.parquet (its OSError carries the
    message, not the errno): exit 3 naming the cache, no half-built folder left."""
    from muse_stack.data import build

    def full(rows, path, chunk_rows=256, on_chunk=None):
        Path(path).write_bytes(b"PAR1")
        raise OSError(f"Error writing bytes to file. Detail: [errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}")

    monkeypatch.setattr(build, "write_parquet", full)
    cache = tmp_path / "cache"
    rc, _, err = cli("data", "build", "tiny-cpu", "--cache", cache, "--json")
    said = " ".join(err.split())
    assert rc == 3 and "--cache" in said and "full" in said and str(cache) in said, err
    assert _left(cache) == []
