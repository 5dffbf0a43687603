"""A run never writes over what is not its own, never starts over while a complete checkpoint is
there, and a run directory it cannot write is a clear refusal: a user's recipe.yaml in the
``--out`` folder, a lost ``checkpoints/latest``, a read-only file system."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from muse_stack.run import checkpoints, dirlock

ROOT = Path(__file__).resolve().parents[2]
#: two rows a step, a checkpoint every 2 steps and every one kept
QUICK = ["training.measure_warmup_steps=1", "batch.gbs=2", "training.checkpoint_interval=2",
         "training.keep_checkpoints=null"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_users_recipe_in_the_out_folder_is_never_replaced(tmp_path, cli, one_thread):
    """`run exp/recipe.yaml --out exp --resume auto`: exp/ holds the user's own recipe (with its
    comments), not a run: refused, nothing in it changed; the plain run's refusal does not point at
    --resume auto, which is that same trap; --resume exp is refused the same way."""
    exp = tmp_path / "exp"
    exp.mkdir()
    own = "# my experiment: keep these words\n" + (ROOT / "recipes" / "tiny-cpu.yaml").read_text()
    (exp / "recipe.yaml").write_text(own)
    before = _snapshot(exp)
    rc, _, err = cli("run", exp / "recipe.yaml", "--out", exp, "--resume", "auto", "--steps", "2", "--no-progress",
                     *QUICK)
    said = " ".join(err.split())
    assert rc == 3 and "not a run directory" in said and "--out" in said, err
    assert _snapshot(exp) == before
    rc, _, err = cli("run", exp / "recipe.yaml", "--out", exp, "--steps", "2", "--no-progress", *QUICK)
    said = " ".join(err.split())
    assert rc == 3 and "not a run directory" in said and "--resume" not in said, err
    assert _snapshot(exp) == before
    rc, _, err = cli("run", "--resume", exp, "--no-progress")
    assert rc == 3 and "not a run directory" in " ".join(err.split()), err
    assert _snapshot(exp) == before


@pytest.fixture
def stopped(tmp_path, cli, one_thread):
    """A run of 4 steps interrupted after step 3: checkpoints at steps 2 and 3, latest naming 3."""
    out = tmp_path / "run"
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--steps", "4", "--stop-after", "3", "--no-progress", *QUICK)
    assert rc == 1 and checkpoints.latest(out).step == 3, err
    assert [c.step for c in checkpoints.step_folders(out)] == [2, 3]
    return out


def test_a_lost_latest_resumes_from_the_newest_complete_checkpoint(stopped, cli):
    """Without checkpoints/latest the run continues from the newest complete step folder, says so
    and writes the pointer again; it neither starts over nor discards the checkpoints."""
    out = stopped
    (out / "checkpoints" / "latest").unlink()
    rc, text, err = cli("run", "tiny-cpu", "--out", out, "--resume", "auto", "--steps", "4", "--no-progress",
                        "--dry-run", *QUICK)
    assert rc == 0 and "from step 3" in text and "checkpoints/latest is missing" in " ".join(err.split()), text + err
    assert not (out / "checkpoints" / "latest").exists()  # a dry run writes nothing
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--resume", "auto", "--steps", "4", "--no-progress", *QUICK)
    assert rc == 0, err
    assert "checkpoints/latest is missing" in " ".join(err.split()) and "step-00000003" in err
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "completed" and results["resumed_at_step"] == 3
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert checkpoints.latest(out).step == 4 and checkpoints.latest(out).named
    assert [c.step for c in checkpoints.step_folders(out)] == [2, 3, 4]


def test_resuming_on_a_read_only_file_system_is_a_clear_refusal(stopped, cli, monkeypatch):
    """The lock file cannot be opened for writing (EROFS, as on a read-only mount; the tests run as
    root, where a read-only mode would not stop the write): exit 3 naming the directory and the fix,
    not an internal error; nothing in the run directory changes."""
    out = stopped
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if Path(path).name == dirlock.LOCK and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(dirlock.os, "open", read_only)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    rc, _, err = cli("run", "--resume", out, "--no-progress")
    said = " ".join(err.split())
    assert rc == 3 and str(out) in said and "Read-only file system" in said and "writable" in said, err
    rc, _, err = cli("run", "tiny-cpu", "--out", out, "--resume", "auto", "--steps", "4", "--no-progress", *QUICK)
    said = " ".join(err.split())
    assert rc == 3 and "--out" in said and "Read-only file system" in said, err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
