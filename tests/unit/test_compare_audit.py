"""Audit of a fingerprint against the attune-b200 recorded stack."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from muse_stack.cli import main
from muse_stack.compare.audit import MATCH, MISMATCH, NOT_VERIFIABLE, audit, expectations
from muse_stack.compare.versions import first_version, versions_match

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/fingerprints"
B200 = json.loads((FIXTURES / "crafted-b200-attune.json").read_text())
CPU = json.loads((FIXTURES / "cpu-debian12-torch2.13.json").read_text())

# the attune-b200 recorded stack, as the record states it
ATTUNE_STACK = {
    "framework": "miles commit bfdcff0e (radixark/miles PR #4111, the commit of the published "
    "radixark/miles:muse-spark-open image), no local changes",
    "megatron_lm": "radixark/Megatron-LM commit 6530834a (branch muse-spark-open; megatron-core 0.19.0), no local changes",
    "transformer_engine": "2.17.0 (PyTorch extension rebuilt against the installed PyTorch for sm90 and sm100)",
    "pytorch": "2.14.1 (CUDA 13.0 build)",
    "cuda": "13.0",
    "nccl": "2.30.7 (CUDA 13.3 build; printed by the measured run)",
    "cudnn": "9.22.0.52 (runs the attention, `--attention-backend fused`)",
    "flash_attn": "2.7.4.post1 (rebuilt against the installed PyTorch for sm90 and sm100; the recipe does not use it)",
    "deepep": "sgl-deep-ep 0.1.2.post1 (installed; the alltoall dispatcher does not use it)",
    "python": "3.12.3",
    "network": "8 GPUs per node, EFA 1.49 (aws-ofi-nccl 1.20), 3.2 Tb/s RDMA per node",
    "source": "version check of the measured run's training image",
}


def statuses(report) -> dict[str, str]:
    return {c.component: c.status for c in report.checks}


def test_parsing_the_free_text_record():
    exp = {e.component: e.expected for e in expectations(ATTUNE_STACK)}
    assert exp == {
        "miles commit": "bfdcff0e",
        "megatron-core": "0.19.0",
        "Megatron-LM commit": "6530834a (no local changes)",
        "transformer_engine": "2.17.0",
        "pytorch": "2.14.1",
        "pytorch CUDA build": "13.0",
        "cuda": "13.0",
        "nccl": "2.30.7",
        "cudnn": "9.22.0.52",
        "flash_attn": "2.7.4.post1",
        "deepep": "0.1.2.post1",
        "python": "3.12.3",
        "GPUs per node": "8",
        "efa": "1.49",
        "aws-ofi-nccl": "1.20",
    }


@pytest.mark.parametrize(
    "recorded, loaded, same",
    [
        ("1.49", "1.49.0", True),
        ("2.14.1", "2.14.1+cu130", True),
        ("9.22.0.52", "9.22.0", True),
        ("0.1.2.post1", "0.1.2", False),
        ("2.17.0", "2.17.0rc1", False),
        ("13.0", "12.8", False),
        ("1.20", "1.20.0-aws", True),
        ("3.12.3", "3.12.4", False),
    ],
)
def test_version_matching(recorded, loaded, same):
    assert versions_match(recorded, loaded) is same


def test_first_version_in_text():
    assert first_version("2.17.0 (PyTorch extension rebuilt)") == "2.17.0"
    assert first_version("sgl-deep-ep 0.1.2.post1 (installed)") == "0.1.2.post1"
    assert first_version("miles commit bfdcff0e") is None


def test_matching_stack_all_match_except_unrecorded_framework():
    report = audit(ATTUNE_STACK, B200)
    s = statuses(report)
    assert s.pop("miles commit") == NOT_VERIFIABLE
    assert set(s.values()) == {MATCH}, s
    assert report.exit_code == 1
    cudnn = next(c for c in report.checks if c.component == "cudnn")
    assert "3 components" in cudnn.note


def test_mismatches_and_unverifiable_components():
    doc = copy.deepcopy(B200)
    doc["python"]["version"] = "3.12.4"
    doc["cuda_libraries"]["nccl"]["version"] = "2.29.2"
    doc["frameworks"]["megatron_core"]["git"]["dirty"] = True
    doc["frameworks"]["deepep"]["distributions"] = {"deep-ep": "0.1.2.post1"}
    doc["network"]["efa"] = {"absent": "EFA installer not present (/opt/amazon/efa_installed_packages missing)"}
    del doc["frameworks"]["flash_attn"]
    report = audit(ATTUNE_STACK, doc)
    s = statuses(report)
    assert s["python"] == MISMATCH
    assert s["nccl"] == MISMATCH
    assert s["Megatron-LM commit"] == MISMATCH
    assert s["deepep"] == MISMATCH
    assert s["efa"] == NOT_VERIFIABLE
    assert s["flash_attn"] == NOT_VERIFIABLE
    assert s["transformer_engine"] == MATCH and s["aws-ofi-nccl"] == MATCH
    notes = {c.component: c.note for c in report.checks}
    assert "efa_installed_packages missing" in notes["efa"]
    assert "has no frameworks.flash_attn" in notes["flash_attn"]
    assert "local changes" in notes["Megatron-LM commit"]
    assert report.exit_code == 2


def test_cpu_fingerprint_against_attune():
    report = audit(ATTUNE_STACK, CPU)
    s = statuses(report)
    assert s["pytorch"] == MISMATCH  # 2.13.0+cpu is not 2.14.1
    assert s["cuda"] == NOT_VERIFIABLE and s["GPUs per node"] == NOT_VERIFIABLE
    assert s["transformer_engine"] == NOT_VERIFIABLE
    assert report.exit_code == 2


def make_run(tmp_path: Path, fingerprint: dict, stack: dict | None) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "fingerprint.json").write_text(json.dumps(fingerprint))
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "attune-b200", "stack": stack}))
    return run


def test_cli_audit_run_directory(tmp_path, capsys):
    run = make_run(tmp_path, B200, ATTUNE_STACK)
    assert main(["audit", str(run), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {"match": 14, "mismatch": 0, "not verifiable": 1}
    stack = dict(ATTUNE_STACK)
    del stack["framework"]
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "x", "stack": stack}))
    assert main(["audit", str(run)]) == 0
    assert "14 match, 0 mismatch, 0 not verifiable → exit 0" in capsys.readouterr().out.replace("\n", " ")


def test_cli_audit_without_recorded_stack_or_recipe(tmp_path, capsys):
    run = make_run(tmp_path, B200, None)
    assert main(["audit", str(run)]) == 3
    assert "records no stack" in capsys.readouterr().err
    (run / "recipe.yaml").unlink()
    assert main(["audit", str(run)]) == 3
    assert "recipe.yaml does not exist" in capsys.readouterr().err


def test_cli_audit_against_catalogue_recipe(tmp_path, capsys):
    pytest.importorskip("muse_stack.recipes.catalogue")
    fp = tmp_path / "fp.json"
    fp.write_text(json.dumps(B200))
    assert main(["audit", str(fp), "--recipe", "attune-b200", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["counts"]["match"] == 14 and out["counts"]["mismatch"] == 0


def test_cli_audit_of_a_cpu_run_without_a_recorded_stack_uses_its_image_lock(tmp_path, capsys):
    """tiny-cpu records no stack: its run is audited against the pins of its machine's image
    (containers/locks/cpu.toml), component by component, not refused."""
    from muse_stack.stack.lock import load
    from muse_stack.stack.record import stack_of_lock

    run = tmp_path / "run"
    run.mkdir()
    (run / "fingerprint.json").write_text(json.dumps(CPU))
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "tiny-cpu", "hardware": {"gpu": "cpu", "count": 1}}))
    rc = main(["audit", str(run), "--json"])
    out = json.loads(capsys.readouterr().out)
    lock = load("cpu").lock
    assert out["recorded_stack"].startswith("lock cpu")
    checks = {c["component"]: c for c in out["checks"]}
    assert checks["pytorch"]["expected"] == lock.components.torch.version
    assert checks["python"]["expected"] == lock.python.version
    assert set(checks) == {"python", "pytorch"} == set(stack_of_lock(lock))  # nothing the cpu lock leaves null
    assert rc == out["exit_code"] and rc in (0, 1, 2)
    # the same, named explicitly, for a fingerprint file; and not together with --recipe
    assert main(["audit", str(run / "fingerprint.json"), "--lock", "cpu", "--json"]) == rc
    assert json.loads(capsys.readouterr().out)["checks"] == out["checks"]
    assert main(["audit", str(run), "--lock", "cpu", "--recipe", "tiny-cpu"]) == 3
    assert "--lock" in capsys.readouterr().err


def test_stack_of_a_gpu_lock_is_read_by_the_audit_parsers():
    """Every pin a GPU lock states lands on a component the audit checks, with the lock's version."""
    from muse_stack.stack.lock import load
    from muse_stack.stack.record import stack_of_lock

    lock = load("b200").lock
    found = {e.component: e.expected for e in expectations(stack_of_lock(lock))}
    assert found["pytorch"] == lock.components.torch.version
    assert found["nccl"] == lock.components.nccl.version
    assert found["efa"] == lock.components.efa.installer_version
    assert found["aws-ofi-nccl"] == lock.components.efa.aws_ofi_nccl
