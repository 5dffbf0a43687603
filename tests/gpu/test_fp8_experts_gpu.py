"""On a GPU: FP8 on the allgather dispatcher that slice-1gpu ships. The engine's expert path (rows padded to the FP8
multiple around the fused unweighted SwiGLU) computes megatron-core's expert forward bit for bit
(lab.verify.fp8_experts says why), and both train."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muse_stack.engines.megatron_available import missing

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or missing() is not None,
                                 reason=f"needs CUDA, Transformer Engine and megatron-core ({missing()})")]


def test_fp8_experts_pad_and_match_megatron_core(tmp_path):
    """Its own process: deterministic mode sets process-wide switches."""
    out = tmp_path / "fp8-experts.json"
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT), str(ROOT / "benchmarks")]))
    subprocess.run([sys.executable, "-m", "lab.verify.fp8_experts", "--steps", "2", "--out", str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": path})
    result = json.loads(out.read_text())
    ours, theirs = result["engine_forward"], result["megatron_core_forward"]
    assert ours["engine_path"] == [True] and theirs["engine_path"] == [False]
    assert ours["largest_expert_rows"] < 16  # every expert's rows were padded
    assert ours["losses"][0] == theirs["losses"][0]  # the same forward arithmetic
    for run in (ours, theirs):
        assert all(math.isfinite(x) for x in run["losses"] + run["grad_norms"])
