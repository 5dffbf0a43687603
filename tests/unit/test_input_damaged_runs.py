"""Inputs that ended in an internal error (exit 70) get the project's own error instead: a damaged
recipe.yaml, checkpoint recipe or metrics log on --resume, `export --hf` under a file, an export
whose checkpoint the still-running job prunes, and a model vocabulary smaller than the tokenizer's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from muse_stack.util.errors import INTERNAL_ERROR


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from muse_stack.cli import main

    path = tmp_path_factory.mktemp("runs") / "r"
    rc = main(["run", "tiny-cpu", "--steps", "2", "training.checkpoint_interval=1", "--out", str(path),
               "--no-progress"])
    assert rc == 0
    return path


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def _clear(result, code: int, *needles: str) -> str:
    rc, out, err = result
    assert rc == code and rc != INTERNAL_ERROR, (rc, out, err)
    assert "Traceback" not in err and "internal error" not in err and "fix:" in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "recipe.yaml").write_bytes(b"\x00\x01\xff\xfe" * 50), "not UTF-8"),
    (lambda d: (d / "recipe.yaml").write_text("name: [unclosed\n"), "not valid YAML"),
    (lambda d: (d / "checkpoints" / "step-00000002" / "recipe.yaml").write_bytes(b"\xff\xfe\x00"), "not UTF-8"),
    (lambda d: (d / "checkpoints" / "step-00000002" / "recipe.yaml").write_text("a: [\n"), "not valid YAML"),
    (lambda d: (d / "checkpoints" / "step-00000002" / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe{\n'),
     "not UTF-8"),
    (lambda d: (d / "checkpoints" / "step-00000002" / "metrics.jsonl").write_text('{"step": 1}\n{"step": \n'),
     "not valid JSON"),
])
def test_a_damaged_run_directory_is_a_clear_error_on_resume(cli, run_dir, tmp_path, damage, needle):
    copy = _copy(run_dir, tmp_path)
    damage(copy)
    _clear(cli("run", "--resume", copy, "--steps", "3", "--allow-change", "--no-progress"), 3, needle)


def test_export_under_a_file_is_a_clear_error(cli, run_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _clear(cli("export", run_dir, "--hf", blocker / "sub" / "out"), 3, "--hf", "is a file")
    assert blocker.read_text() == "x"


def test_export_while_the_run_prunes_its_checkpoint(cli, run_dir, tmp_path, monkeypatch):
    """The job saves step 3 and prunes step 2 after export read checkpoints/latest: the export
    takes step 3; if the job keeps pruning under it, it says so instead of crashing."""
    import muse_stack.models.muse_spark.checkpoint as ckpt

    copy = _copy(run_dir, tmp_path)
    root = copy / "checkpoints"
    real = ckpt._weight_files

    def save_and_prune(step: int) -> None:
        old = json.loads((root / "latest").read_text())
        new = f"step-{step:08d}"
        shutil.copytree(root / old["folder"], root / new)
        (root / new / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")
        (root / "latest").write_text(json.dumps({"step": step, "folder": new}) + "\n")
        shutil.rmtree(root / old["folder"])

    calls = []

    def racing(folder, *a, **k):  # the files are listed, then the folder goes before they are opened
        calls.append(folder)
        files = real(folder, *a, **k)
        if len(calls) == 1:
            save_and_prune(3)
        return files

    monkeypatch.setattr(ckpt, "_weight_files", racing)
    rc, out, err = cli("export", copy, "--hf", tmp_path / "hf")
    assert rc == 0 and "exported step 3" in out, (rc, out, err)
    assert (tmp_path / "hf" / "config.json").is_file()

    calls.clear()

    def always(folder, *a, **k):
        files = real(folder, *a, **k)
        save_and_prune(int(json.loads((root / "latest").read_text())["step"]) + 1)
        return files

    calls.clear()

    def early(folder, *a, **k):  # pruned before the files are listed: the export's own error, then a retry
        calls.append(folder)
        if len(calls) == 1:
            save_and_prune(int(json.loads((root / "latest").read_text())["step"]) + 1)
        return real(folder, *a, **k)

    monkeypatch.setattr(ckpt, "_weight_files", early)
    rc, out, err = cli("export", copy, "--hf", tmp_path / "hf3")
    assert rc == 0 and "exported step 4" in out, (rc, out, err)

    monkeypatch.setattr(ckpt, "_weight_files", always)
    _clear(cli("export", copy, "--hf", tmp_path / "hf2"), 3, "still saving checkpoints", "export again")
    assert not (tmp_path / "hf2").exists()


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_before_the_run(cli, tmp_path):
    err = _clear(cli("run", "tiny-cpu", "--steps", "1", "model.overrides.vocab_size=100", "--out", tmp_path / "v"),
                 2, "model.vocab_size", "512")
    assert "vocab_size=512" in err
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("damage, needle", [(b"\xff\xfe\x00", "not UTF-8"), (b"a: [\n", "not valid YAML")])
def test_export_of_a_checkpoint_with_a_damaged_recipe_is_a_clear_error(cli, run_dir, tmp_path, damage, needle):
    copy = _copy(run_dir, tmp_path)
    (copy / "checkpoints" / "step-00000002" / "recipe.yaml").write_bytes(damage)
    _clear(cli("export", copy, "--hf", tmp_path / "hf"), 3, needle)
    assert not (tmp_path / "hf").exists()


def test_resume_auto_over_a_completed_run_with_a_damaged_recipe_is_a_clear_error(cli, run_dir, tmp_path):
    copy = _copy(run_dir, tmp_path)
    (copy / "recipe.yaml").write_bytes(b"\x00\x01\xff\xfe" * 50)
    _clear(cli("run", "tiny-cpu", "--steps", "2", "training.checkpoint_interval=1", "--resume", "auto", "--out",
               copy, "--no-progress"), 3, "not UTF-8")
