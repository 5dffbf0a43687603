"""benchmarks/scripts/flash_attn_check.py, the flash-attn replay's check, on a CPU: its comparison passes an
attention that is right to flash-attn's own test bound and fails one that is not (a wrong mask, a wrong scale),
its result header is a valid result.json, and on a machine without CUDA it refuses with the reason. The GPU run
itself (flash_attn_func in the replay venv) is `replay.sh fa-check LOCK` on the GPU machine."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("flash_attn_check", ROOT / "benchmarks" / "scripts" / "flash_attn_check.py")
fac = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fac)
torch = pytest.importorskip("torch")

SMALL = {"batch": 1, "seqlen": 64, "heads": 2, "head_dim": 32}


def _as_flash(fn):
    """A (batch, seqlen, heads, dim) attention with flash_attn_func's signature."""
    return lambda q, k, v, causal: fn(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_an_attention_right_at_the_inputs_precision_passes(causal):
    # SDPA itself at the input precision: its error is PyTorch's own, within the bound
    case = fac.compare(_as_flash(fac.reference), "bfloat16", causal, "cpu", SMALL)
    assert case["ok"], case
    assert set(case["tensors"]) == {"out", "dq", "dk", "dv"}
    assert all(t["pytorch_max_abs_error"] > 0 for t in case["tensors"].values())


def test_a_wrong_mask_or_scale_fails():
    wrong_mask = fac.compare(_as_flash(lambda q, k, v, causal: fac.reference(q, k, v, not causal)), "bfloat16", True,
                             "cpu", SMALL)
    assert not wrong_mask["ok"] and not wrong_mask["tensors"]["out"]["ok"]
    wrong_scale = fac.compare(_as_flash(lambda q, k, v, causal: fac.reference(q * 1.05, k, v, causal)), "bfloat16",
                              False, "cpu", SMALL)
    assert not wrong_scale["ok"]


def test_the_bounds_are_flash_attns_own():
    assert fac.BOUND == {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
    assert not math.isinf(fac.compare(_as_flash(fac.same_precision), "float16", False, "cpu", SMALL)["tensors"]["out"]["ratio"])


def test_the_result_header_is_a_valid_result_json(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import schema

    report = {"want_version": "2.7.4.post1", "want_archs": ["9.0", "10.0"], "ok": True, "device": "NVIDIA H200"}
    header = fac.result_header(report, "b200")
    assert header["id"] == "replay-b200-flash-attn" and "for 90;100" in header["claim"]
    schema.Result.model_validate(header)
    assert "do not all agree" in fac.result_header({**report, "ok": False}, "b200")["claim"]


def test_without_cuda_it_refuses_with_the_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/scripts/flash_attn_check.py"), "--lock", "b200",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "no CUDA device" in r.stderr
