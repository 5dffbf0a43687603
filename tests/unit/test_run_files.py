"""Files on shared storage: a run directory, its checkpoints and an export follow the process umask
(group-readable under 0027), while a file written private stays 0600 whatever the umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from muse_stack.util import atomic
from muse_stack.run.pipeline import run


@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)

    before = os.umask(0o022)
    os.umask(before)
    yield set_mask
    os.umask(before)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)) or ".": stat.S_IMODE(p.stat().st_mode)
            for p in [root, *root.rglob("*")] if not p.is_symlink()}


def test_runs_checkpoints_and_exports_follow_the_umask(tmp_path, umask, monkeypatch, one_thread):
    from muse_stack.publish.hf import export_run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    umask(0o027)  # a team's shared storage: the group reads, others nothing
    out = run("tiny-cpu", out=tmp_path / "shared" / "run", steps=3, progress=False,
              overrides=["batch.gbs=2", "training.measure_warmup_steps=1", "training.checkpoint_interval=2"])
    assert out.status == "completed"
    export_run(out.path, tmp_path / "shared" / "hf")
    for root in (out.path, tmp_path / "shared" / "hf"):
        found = modes(root)
        assert any("step-00000003" in k for k in found) or root.name == "hf"
        for name, mode in found.items():
            is_dir = (root / name).is_dir()
            if name == ".lock":
                continue
            want = 0o750 if is_dir else 0o640
            assert mode == want, f"{root.name}/{name}: {oct(mode)}, the umask gives {oct(want)}"


def test_a_private_file_stays_0600_whatever_the_umask(tmp_path, umask):
    umask(0o000)
    public = atomic.write_text(tmp_path / "notes.txt", "hello")
    secret = atomic.write_text(tmp_path / "token", "s3cret", private=True)
    assert stat.S_IMODE(public.stat().st_mode) == 0o666
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    staging = atomic.make_temp_dir(tmp_path / "folder")
    assert stat.S_IMODE(staging.stat().st_mode) == 0o777
