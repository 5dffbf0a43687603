"""Capturing a fingerprint on this machine: sections, absent reasons, secrets, timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muse_stack.fingerprint import SCHEMA_VERSION, capture, is_absent, load_fingerprint
from muse_stack.fingerprint.tree import leaves

REPO = Path(__file__).resolve().parents[2]
SECRET = "supersecret-hf-0123456789"
API_SECRET = "my-api-key-value-987654"
SECTIONS = ("identity", "host", "gpu", "cuda_libraries", "frameworks", "network", "python", "environment", "run_inputs")

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency of the dev env
    HAS_CUDA = False


@pytest.fixture(scope="module")
def doc() -> dict:
    saved = dict(os.environ)
    os.environ.update({"HF_TOKEN": SECRET, "MY_API_KEY": API_SECRET, "NCCL_DEBUG": "INFO",
                       "NVTE_FUSED_ATTN": "1", "MUSE_STACK_IMAGE_DIGEST": "sha256:" + "c" * 64,
                       "LD_LIBRARY_PATH": f"/opt/{SECRET}/lib"})
    try:
        return capture(recipe_sha256="a" * 64, rows_sha256="b" * 64,
                       extra={"note": f"token is {SECRET}", "wandb_api_key": "k" * 12, "engine": "cpu"})
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_schema_and_sections(doc):
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["kind"] == "muse-stack-fingerprint"
    for section in SECTIONS:
        assert section in doc, section
    assert doc["run_inputs"] == {"recipe_sha256": "a" * 64, "rows_sha256": "b" * 64}
    assert doc["identity"]["image_digest"] == "sha256:" + "c" * 64
    assert json.loads(json.dumps(doc)) == doc  # plain JSON


def test_every_absent_field_has_a_reason(doc):
    for path, value in leaves(doc):
        if isinstance(value, dict) and "absent" in value:
            assert is_absent(value), path
            assert len(value["absent"]) > 10, path


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only behaviour")
def test_cpu_machine_marks_gpu_and_network_absent(doc):
    assert is_absent(doc["gpu"])
    assert "NVML" in doc["gpu"]["absent"] or "pynvml" in doc["gpu"]["absent"]
    assert is_absent(doc["cuda_libraries"])
    assert "CUDA not available" in doc["cuda_libraries"]["absent"]
    assert is_absent(doc["network"]["efa"]) and "efa_installed_packages" in doc["network"]["efa"]["absent"]
    assert is_absent(doc["network"]["libfabric"]) and "fi_info" in doc["network"]["libfabric"]["absent"]
    assert is_absent(doc["network"]["aws_ofi_nccl"])


def test_frameworks_and_python(doc):
    torch_fw = doc["frameworks"]["torch"]
    import torch

    assert torch_fw["module_version"] == torch.__version__
    assert torch_fw["git_version"] == torch.version.git_version
    libs = torch_fw["compiled_libraries"]
    loaded = [name for name, rec in libs.items() if rec["loaded"]]
    assert any("libtorch" in name for name in loaded)
    for rec in libs.values():
        assert len(rec["sha256"]) == 64 and rec["size"] > 0
    assert isinstance(torch_fw["settings"]["deterministic_algorithms"], bool)
    py = doc["python"]
    assert py["distributions"]["torch"] == torch_fw["version"]
    assert py["distribution_count"] == len(py["distributions"])
    assert len(py["distributions_sha256"]) == 64
    for key in ("transformer_engine", "megatron_core", "flash_attn", "deepep", "triton"):
        assert key in doc["frameworks"]


def test_environment_allow_list_and_secrets(doc):
    env = doc["environment"]
    assert env["variables"]["NCCL_DEBUG"] == "INFO"
    assert env["variables"]["NVTE_FUSED_ATTN"] == "1"
    assert "HF_TOKEN" in env["secrets_set"] and "MY_API_KEY" in env["secrets_set"]
    assert "HF_TOKEN" not in env["variables"]
    text = json.dumps(doc)
    assert SECRET not in text
    assert API_SECRET not in text
    assert "k" * 12 not in text  # secret-named key in extra
    assert doc["extra"]["wandb_api_key"] == {"set": True}
    assert doc["extra"]["engine"] == "cpu"
    assert "<redacted>" in env["variables"]["LD_LIBRARY_PATH"]


def test_cli_never_prints_secrets(tmp_path):
    # (how long a capture takes is a measurement, not a test: see docs/comparing.md)
    env = dict(os.environ, HF_TOKEN=SECRET, MY_API_KEY=API_SECRET, WANDB_API_KEY=API_SECRET + "w")
    out = tmp_path / "fp.json"
    proc = subprocess.run([sys.executable, "-m", "muse_stack.cli", "fingerprint", "-o", str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    written = out.read_text()
    for secret in (SECRET, API_SECRET):
        assert secret not in written
        assert secret not in proc.stdout + proc.stderr
    doc = load_fingerprint(out)
    assert {"HF_TOKEN", "MY_API_KEY", "WANDB_API_KEY"} <= set(doc["environment"]["secrets_set"])
    assert doc["capture"]["seconds"] > 0

    proc = subprocess.run([sys.executable, "-m", "muse_stack.cli", "fingerprint"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0
    assert SECRET not in proc.stdout and API_SECRET not in proc.stdout
    assert json.loads(proc.stdout)["schema_version"] == SCHEMA_VERSION


def test_cpu_fixture_is_a_real_capture():
    doc = load_fingerprint(REPO / "tests/fixtures/fingerprints/cpu-debian12-torch2.13.json")
    assert is_absent(doc["gpu"]) and is_absent(doc["cuda_libraries"])
    assert doc["frameworks"]["torch"]["version"].endswith("+cpu")
    assert doc["capture"]["seconds"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_capture_reads_loaded_libraries(doc):
    import torch

    gpu = doc["gpu"]
    assert gpu["count"] == torch.cuda.device_count() or gpu["count"] >= torch.cuda.device_count()
    assert all("." in cc for cc in gpu["compute_capabilities"])
    libs = doc["cuda_libraries"]
    assert libs["cuda_runtime"]["torch_build"] == torch.version.cuda
    cudnn = torch.backends.cudnn.version()
    assert libs["cudnn"]["encoded"] == cudnn
    major = cudnn // 10000 if cudnn >= 90000 else cudnn // 1000
    assert libs["cudnn"]["version"].startswith(f"{major}.")
    nccl = ".".join(str(x) for x in torch.cuda.nccl.version()[:3])
    assert libs["nccl"]["version"] == nccl
    for name in ("cublas", "cudnn", "nccl"):
        files = libs[name]["files"]
        assert not is_absent(files), name
        assert all(len(rec["sha256"]) == 64 for rec in files.values())
    assert doc["frameworks"]["torch"]["arch_list"]
