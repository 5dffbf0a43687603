"""numerics.deterministic, the final-checkpoint switch, and compare's bitwise verdict."""

from __future__ import annotations

import json

import pytest
import torch

from muse_stack.compare import compare_runs
from muse_stack.run.pipeline import run

QUICK = ["training.measure_warmup_steps=1", "batch.gbs=2"]


@pytest.fixture
def clean_numerics(monkeypatch, one_thread):
    """The deterministic mode sets process-wide state: put it back for the other tests."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


@pytest.mark.slow
def test_two_deterministic_runs_are_bitwise_identical_and_compare_says_so(tmp_path, clean_numerics):
    det = [*QUICK, "numerics.deterministic=true", "training.final_checkpoint=false"]
    a = run("tiny-cpu", out=tmp_path / "a", steps=4, progress=False, overrides=det)
    b = run("tiny-cpu", out=tmp_path / "b", steps=4, progress=False, overrides=det)
    assert a.status == b.status == "completed"
    report = compare_runs(tmp_path / "a", tmp_path / "b", make_plot=False)
    assert report.bitwise["identical"] is True, report.bitwise
    assert report.as_dict()["bitwise"]["steps"] == 4
    fp = json.loads((tmp_path / "a" / "fingerprint.json").read_text())
    text = json.dumps(fp)
    # the fingerprint records what the switch set, and the process state it measured
    assert '"CUBLAS_WORKSPACE_CONFIG": ":4096:8"' in text
    assert '"deterministic_algorithms": true' in text
    # a different seed is not identical, and the first difference is named
    c = run("tiny-cpu", out=tmp_path / "c", steps=4, progress=False, overrides=[*det, "training.seed=99"])
    assert c.status == "completed"
    other = compare_runs(tmp_path / "a", tmp_path / "c", make_plot=False)
    assert other.bitwise["identical"] is False
    assert other.bitwise["first_difference"]["step"] == 1


def test_a_conflicting_environment_is_refused_naming_the_switch(tmp_path, cli, clean_numerics, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    rc, out, err = cli("run", "tiny-cpu", "numerics.deterministic=true", "--steps", "2", "--out", tmp_path / "r",
                       "--no-progress")
    assert rc == 2
    assert "numerics.deterministic" in out + err and "CUBLAS_WORKSPACE_CONFIG" in out + err
    assert not (tmp_path / "r").exists()  # refused before any output


def test_final_checkpoint_off_keeps_no_weights(tmp_path, clean_numerics):
    out = tmp_path / "nofinal"
    outcome = run("tiny-cpu", out=out, steps=3, progress=False, overrides=[*QUICK, "training.final_checkpoint=false"])
    assert outcome.status == "completed"
    assert not (out / "checkpoints" / "latest").exists()
    # an interval still saves
    out2 = tmp_path / "interval"
    run("tiny-cpu", out=out2, steps=3, progress=False,
        overrides=[*QUICK, "training.final_checkpoint=false", "training.checkpoint_interval=2"])
    assert json.loads((out2 / "checkpoints" / "latest").read_text())["step"] == 2
