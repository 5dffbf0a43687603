"""On a GPU: the step's first micro-batch writing the main gradients gives the gradients that zeroing
the whole buffer gives, bit for bit (lab.verify.first_writes); and the experts' SwiGLU, whose
backward is Transformer Engine's kernel, is within one rounding of the exact values, as megatron-core's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muse_stack.engines.megatron_available import missing

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or missing() is not None,
                                 reason=f"needs CUDA, Transformer Engine and megatron-core ({missing()})")]


def test_first_micro_batch_writes_the_same_gradients(tmp_path):
    """In deterministic mode the two ways differ only in whether the first micro-batch's GEMMs add
    their product to zeros or write it (beta 1 on a zero output, or beta 0): the same sums, so every
    element of every grad buffer must be equal. The buffers start NaN before each step, so an element
    that was neither zeroed nor written is not finite. Its own process: deterministic mode sets
    process-wide switches."""
    out = tmp_path / "first-writes.json"
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT), str(ROOT / "benchmarks")]))
    subprocess.run([sys.executable, "-m", "lab.verify.first_writes", "--steps", "2", "--out", str(out)],
                   check=True, env={**os.environ, "PYTHONPATH": path})
    result = json.loads(out.read_text())
    assert result["first_writes"].startswith("the step's first micro-batch writes")
    assert result["whole_buffer"].startswith("the whole buffer")
    # 32 tokens, each to 1 of 64 experts: at least 32 experts of every MoE layer ran a GEMM of no rows
    assert result["empty_experts_first_micro_batch"] and min(result["empty_experts_first_micro_batch"]) >= 32
    assert len(result["buffers"]) >= 2
    for b in result["buffers"]:
        assert b["non_finite_written"] == 0, b
        assert b["unequal"] == 0, b
    assert result["losses_whole"] == result["losses_first_writes"]
    assert result["grad_norms_whole"] == result["grad_norms_first_writes"]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits: 2^(e - 7) for |x| in [2^e, 2^(e+1)))."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


def test_the_experts_swiglu_is_megatron_cores_within_one_rounding():
    """The experts' SwiGLU (megatron-core's forward, TE's dswiglu backward) and megatron-core's own
    both compute silu(a) * b and its gradients in fp32 and round once to bf16. Against the exact
    values (fp64 from the same bf16 inputs), each result is within one bf16 spacing: half a spacing
    for the rounding, plus the fp32 evaluation's error, at most ~10 operations x 2^-24 of the
    largest term |g| (|b| + 1) (1 + |a|), bounded by 2^-20 of it (it only matters where the
    gradient of a nearly cancels, near a = -1.28)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from muse_stack.engines.mcore.layers import SwiGLUTEBackward

    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, width = 4099, 1536
    x = (torch.randn(rows, 2 * width, device="cuda", generator=gen) * 3).bfloat16()
    g = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    a64, b64, g64 = x[:, :width].double(), x[:, width:].double(), g.double()
    sig = torch.sigmoid(a64)
    exact = a64 * sig * b64
    exact_da = g64 * b64 * sig * (1 + a64 * (1 - sig))
    exact_db = g64 * a64 * sig
    scale = g64.abs() * (b64.abs() + 1) * (1 + a64.abs())
    results = {}
    for name, fn in (("engine", SwiGLUTEBackward.apply), ("megatron-core", lambda t: bias_swiglu_impl(t, None))):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(g)
        results[name] = (y.detach(), xi.grad[:, :width], xi.grad[:, width:])
    for name, (y, da, db) in results.items():
        assert y.dtype == torch.bfloat16 and da.dtype == torch.bfloat16
        assert ((y.double() - exact).abs() <= _bf16_ulp(exact)).all(), name
        assert ((da.double() - exact_da).abs() <= _bf16_ulp(exact_da) + 2.0**-20 * scale).all(), name
        assert ((db.double() - exact_db).abs() <= _bf16_ulp(exact_db) + 2.0**-20 * scale).all(), name
