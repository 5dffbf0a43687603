"""benchmarks/scripts/comm.py, the collective measurement at a recipe's message sizes, on gloo (CPU), so a
GPU call only runs it: every row's result is checked, and the message list is the planner's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lab.messages import BF16, FP32, bus_gbps, step_messages
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
import comm  # noqa: E402


def test_messages_are_the_recipes_tensors():
    recipe = load_recipe("sft-192")
    model = recipe.model_config_resolved()
    t = recipe.batch.mbs * recipe.batch.seq_length // (recipe.layout.cp or 1)
    got = {m.kind: m for m in step_messages(recipe)}
    assert got["tp_allgather"].bytes == BF16 * t * model.hidden_size and got["tp_allgather"].group == 4
    assert got["ep_alltoall"].bytes == BF16 * model.num_experts_per_tok * (t // 4) * model.moe_hidden_size
    # megatron-core's pipeline tensor: the sequence split over TP 4 with sequence parallelism
    assert got["pp_sendrecv"].bytes == FP32 * (t // 4) * model.hidden_size
    assert "edp_reducescatter" not in got  # 192 / (EP 32 x PP 6) = 1: the experts are not replicated
    assert step_messages(load_recipe("tiny-cpu")) == []  # one process sends nothing


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_gbps("allgather", 4, 4e9, 1.0) == pytest.approx(3.0)
    assert bus_gbps("alltoall", 8, 8e9, 2.0) == pytest.approx(3.5)
    assert bus_gbps("sendrecv", 2, 1e9, 1.0) == pytest.approx(1.0)


@pytest.mark.slow
def test_two_gloo_ranks_measure_every_message(tmp_path):
    out = tmp_path / "comm.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "benchmarks" / "scripts" / "comm.py"), "sft-192", "--backend", "gloo", "--max-bytes",
                           "4096", "--iters", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    kinds = [r["kind"] for r in result["rows"]]
    assert kinds == ["tp_allgather", "tp_reducescatter", "ep_alltoall", "pp_sendrecv", "dp_reducescatter",
                     "dp_allgather"]
    for row in result["rows"]:
        assert row["correct"] and row["capped"] and row["group_measured"] == 2
        assert row["busbw_gbps"] > 0 and row["median_s"] > 0


def test_a_wrong_result_is_caught(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for op in ("allgather", "reducescatter", "alltoall"):
            call, check, _ = comm.run_op(op, 64, None, [0], torch.device("cpu"))
            call()
            assert check()
            for cell in call.__closure__:  # the output buffer the check reads
                value = cell.cell_contents
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    value.add_(1.0)
            assert not check(), op
    finally:
        dist.destroy_process_group()
