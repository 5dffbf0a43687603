"""On a GPU: an adapter run with dropout, interrupted and resumed, is bitwise the uninterrupted
run (the checkpoint holds every rank's generators, CUDA and megatron-core's tensor-parallel
tracker included, and the data position), on the megatron engine and on the reference engine.
Skips without CUDA (and, for the megatron engine, Transformer Engine and megatron-core); on a lent
H200 it runs as ``bash benchmarks/scripts/h200.sh resumedrop``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muse_stack.engines.megatron_available import missing

ROOT = Path(__file__).resolve().parents[2]
#: proxy-1gpu with 8 experts (a quick dist-checkpoint) and dense adapters whose input dropout draws
#: a mask every micro-batch; deterministic kernels, so two uninterrupted runs agree bit for bit
OVERRIDES = ["model.overrides.num_local_experts=8", "model.overrides.num_experts_per_tok=2",
             "peft.scheme=lora", "peft.rank=8", "peft.alpha=16", "peft.dropout=0.1", "peft.per_expert=false",
             "peft.targets=[self_attn.q_proj,self_attn.v_proj,self_attn.o_proj]", "numerics.deterministic=true",
             "training.checkpoint_interval=null"]


def rows(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muse_stack.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or missing() is not None,
                    reason=f"needs CUDA, Transformer Engine and megatron-core ({missing()})")
def test_megatron_adapter_dropout_resume_is_bitwise(tmp_path):
    common = ["proxy-1gpu", *OVERRIDES, "--steps", "6", "--no-progress"]
    full = _cli("run", *common, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr[-3000:]
    part = _cli("run", *common, "--stop-after", "3", "--out", str(tmp_path / "part"))
    assert part.returncode == 1, part.stderr[-3000:]  # interrupted, its checkpoint at step 3
    saved = tmp_path / "part" / "checkpoints" / "step-00000003" / "rng" / "rank-00000.pt"
    state = torch.load(saved, weights_only=True)
    assert "torch_cuda" in state["rng"] and state["rng"]["mcore_tracker"] and state["data"]["row"] == 3 * 8
    resumed = _cli("run", "--resume", str(tmp_path / "part"), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(tmp_path / "part") == rows(tmp_path / "full")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reference_engine_dropout_resume_on_a_gpu_is_bitwise(tmp_path):
    """tiny-cpu's model on one GPU (the reference engine, deterministic kernels): its dropout masks
    come from the CUDA generator, which the checkpoint now holds."""
    common = ["tiny-cpu", "hardware.gpu=H200", "hardware.per_node=8", "numerics.deterministic=true",
              "training.measure_warmup_steps=1", "batch.gbs=2", "training.checkpoint_interval=null",
              "peft.scheme=lora", "peft.rank=4", "peft.alpha=8", "peft.dropout=0.25", "peft.per_expert=false",
              "peft.targets=[self_attn.q_proj,self_attn.v_proj,mlp.experts.gate_up_proj]", "--steps", "6",
              "--no-progress"]
    full = _cli("run", *common, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr[-3000:]
    part = _cli("run", *common, "--stop-after", "3", "--out", str(tmp_path / "part"))
    assert part.returncode == 1, part.stderr[-3000:]
    saved = tmp_path / "part" / "checkpoints" / "step-00000003" / "rng" / "rank-00000.pt"
    assert "torch_cuda" in torch.load(saved, weights_only=True)["rng"]
    resumed = _cli("run", "--resume", str(tmp_path / "part"), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(tmp_path / "part") == rows(tmp_path / "full")
