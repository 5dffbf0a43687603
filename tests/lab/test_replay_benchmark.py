"""The committed replay of the b200 and h200 wheel sets on an H200 (benchmarks/results/replay*/): what
benchmarks/results/replay/README.md says of it is what the committed files say, recomputed here on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse_stack.compare.audit import audit
from muse_stack.recipes.catalogue import load_recipe

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SOFTWARE = {"megatron-core", "transformer_engine", "pytorch", "pytorch CUDA build", "cuda", "nccl", "cudnn",
            "deepep", "python"}


@pytest.mark.parametrize("lock", ["b200", "h200"])
def test_every_recorded_software_component_matches(lock):
    stack = load_recipe("attune-b200").stack
    fp = json.loads((BENCH / f"replay-{lock}" / "fingerprint.json").read_text())
    report = audit(stack.model_dump() if hasattr(stack, "model_dump") else dict(stack), fp).as_dict()
    status = {c["component"]: c["status"] for c in report["checks"]}
    assert {k for k, v in status.items() if v == "match"} == SOFTWARE
    assert {k for k, v in status.items() if v == "mismatch"} == {"GPUs per node"}
    committed = json.loads((BENCH / f"replay-{lock}" / "audit-attune-b200.json").read_text())
    assert {c["component"]: c["status"] for c in committed["checks"]} == status


@pytest.mark.parametrize("lock", ["b200", "h200"])
def test_the_run_loaded_only_the_sets_cudnn_and_passed_its_selfcheck_but_flash_attn(lock):
    fp = json.loads((BENCH / f"replay-{lock}" / "fingerprint.json").read_text())
    cudnn = fp["cuda_libraries"]["cudnn"]
    assert cudnn["version"] == "9.22.0"
    assert {Path(f["path"]).parent.as_posix() for f in cudnn["files"].values()} == {"/tmp/lockenv/nvidia/cudnn/lib"}
    check = json.loads((BENCH / f"replay-{lock}" / "selfcheck.json").read_text())
    failing = {c["what"] for c in check["components"] + check["wheel_set"] if not c["ok"]}
    assert failing == {"flash_attn (import)", "flash-attn"}  # not built on the lent machine
    results = json.loads((BENCH / f"replay-{lock}" / "results.json").read_text())
    assert results["status"] == "completed" and results["steps_completed"] == 30


def test_without_the_library_path_two_cudnns_were_mapped():
    fp = json.loads((BENCH / "replay" / "without-cudnn-library-path" / "fingerprint.json").read_text())
    folders = {Path(f["path"]).parent.as_posix() for f in fp["cuda_libraries"]["cudnn"]["files"].values()}
    assert folders == {"/tmp/lockenv/nvidia/cudnn/lib", "/usr/lib/x86_64-linux-gnu"}
    assert fp["cuda_libraries"]["cudnn"]["version"] == "9.14.0"


def test_b200_and_h200_runs_differ_only_in_the_te_extension_and_converge_alike():
    diff = json.loads((BENCH / "replay" / "diff-b200-h200.json").read_text())
    assert diff["counts"] == {"numerics": 2, "performance": 0, "informational": 0}
    assert all("transformer_engine.compiled_libraries" in d["path"] for d in diff["differences"])
    compare = json.loads((BENCH / "replay" / "compare-b200-h200.json").read_text())
    assert compare["passed"] is True


ISOLATED = BENCH / "replay-b200-isolated"


def test_the_isolated_replay_installed_the_whole_set_and_failed_only_on_flash_attn():
    check = json.loads((ISOLATED / "selfcheck.json").read_text())
    failing = {c["what"] for c in check["components"] + check["wheel_set"] if not c["ok"]}
    assert failing == {"flash_attn (import)", "flash-attn"}
    from muse_stack.stack import pylock

    _, packages = pylock.load(ISOLATED / "pylock.b200.toml")  # the set as it was replayed
    installed = {pylock.canonical(p["name"]): p["version"] for p in json.loads((ISOLATED / "pip-list.json").read_text())}
    wanted = {key: str(p.version) for key, p in packages.items()}
    assert set(wanted) - set(installed) == {"flash-attn"}  # every other package of the set, at its version
    assert set(installed) - set(wanted) == set()
    assert all(installed[k].split("+")[0] == v for k, v in wanted.items() if k != "flash-attn")
    install = (ISOLATED / "install.txt").read_text()
    assert "123 packages" in install and "hashes required" in install


def test_the_isolated_replay_loaded_each_cuda_library_once_from_the_venv():
    venv = "/tmp/replayenv-b200/"
    for name in ("isolation.json", "isolation-fingerprint.json"):
        report = json.loads((ISOLATED / name).read_text())
        assert report["ok"] and report["problems"] == []
        assert report["distributions"] == 124 and report["set_packages"] == 125
    loaded = json.loads((ISOLATED / "isolation.json").read_text())["cuda_libraries_loaded"]
    assert loaded and all(len(paths) == 1 and paths[0].startswith(venv) for paths in loaded.values())
    fp = json.loads((ISOLATED / "fingerprint.json").read_text())
    for lib in ("cuda_runtime", "nvrtc", "nvshmem", "cudnn", "nccl", "cublas"):
        entry = fp["cuda_libraries"][lib]
        assert not entry.get("multiple_copies_loaded") and not entry.get("mixed_folders")
        assert all(f["path"].startswith(venv) for f in entry["files"].values())


def test_the_isolated_replay_audits_diffs_and_compares_as_its_readme_says():
    stack = load_recipe("attune-b200").stack
    fp = json.loads((ISOLATED / "fingerprint.json").read_text())
    report = audit(stack.model_dump() if hasattr(stack, "model_dump") else dict(stack), fp).as_dict()
    status = {c["component"]: c["status"] for c in report["checks"]}
    assert {k for k, v in status.items() if v == "match"} == SOFTWARE
    assert {k for k, v in status.items() if v == "mismatch"} == {"GPUs per node"}
    committed = json.loads((ISOLATED / "audit-attune-b200.json").read_text())
    assert {c["component"]: c["status"] for c in committed["checks"]} == status
    diff = json.loads((ISOLATED / "diff-replay-h200.json").read_text())
    numerics = {d["path"] for d in diff["differences"] if d["class"] == "numerics"}
    assert len(numerics) == diff["counts"]["numerics"] == 14
    # the h200 replay (b) mapped cudart and NVRTC twice; this one (a) once
    twice = [d for d in diff["differences"] if d["path"].endswith("multiple_copies_loaded")]
    assert {d["path"].split(".")[1] for d in twice} == {"cuda_runtime", "nvrtc"}
    assert all(d["a"] is None and d["b"] for d in twice)
    assert json.loads((ISOLATED / "compare-replay-h200.json").read_text())["passed"] is True
    results = json.loads((ISOLATED / "results.json").read_text())
    assert results["status"] == "completed" and results["steps_completed"] == 30
    assert results["mfu"] > 0.5 and results["step_time_worst_ratio"] < 1.02  # the README's figures are rendered


def test_the_isolated_replays_flash_attn_build_was_unfinished_as_stated():
    text = (ISOLATED / "fa-unfinished.txt").read_text()
    assert "objects compiled: 46 of 85" in text  # the README's count is rendered from this line
