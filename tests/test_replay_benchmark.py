"""The committed replay of the b200 and h200 wheel sets on an H200 (benchmarks/results/replay*/): what
benchmarks/results/replay/README.md says of it is what the committed files say, recomputed here on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse_stack.compare.audit import audit
from muse_stack.recipes.catalogue import load_recipe

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
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
