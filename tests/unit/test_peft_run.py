"""`muse-stack run tiny-cpu peft.scheme=lora ...` trains adapters on the CPU, checkpoints only
the adapters, resumes to the same losses, and `plan` shows the adapters and filled values."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from muse_stack.models.muse_spark.peft import is_adapter_key

PEFT = ["peft.scheme=lora", "peft.targets=[self_attn.q_proj,self_attn.v_proj,mlp.pre_expert_proj,"
        "mlp.experts.gate_up_proj,mlp.experts.down_proj]", "peft.per_expert=true", "peft.rank=4", "peft.alpha=8",
        "batch.gbs=4", "optimizer.warmup_steps=1"]


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_cpu_trains_lora_and_resumes_from_an_adapter_checkpoint(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread: the loss is the same on every run
    full, part = tmp_path / "full", tmp_path / "part"
    rc, _, err = cli("run", "tiny-cpu", *PEFT, "--steps", "4", "--out", full, "--no-progress")
    assert rc == 0, err
    losses = _losses(full)
    assert len(losses) == 4 and losses[-1] < losses[0]
    results = json.loads((full / "results.json").read_text())
    info = results["engine_info"]
    # MFU counts the frozen base's forward and backward to inputs, not its weight gradients
    assert results["flops_formula"].startswith("model FLOPs/token with adapters")
    assert info["peft"]["rank"] == 4 and 0 < info["trainable_parameters"] < info["parameters"] // 10

    rc, _, _ = cli("run", "tiny-cpu", *PEFT, "--steps", "4", "--stop-after", "2", "--out", part, "--no-progress")
    assert rc == 1
    ckpt = part / "checkpoints" / json.loads((part / "checkpoints" / "latest").read_text())["folder"]
    # the engine's files (adapters only, no base weights) plus the checkpoint manager's recipe and metrics
    # copies and the run's own state of each rank (rng/)
    assert sorted(p.name for p in ckpt.iterdir()) == ["adapters.json", "adapters.safetensors", "metrics.jsonl",
                                                       "optimizer.pt", "recipe.yaml", "rng", "trainer_state.json"]
    stored = load_file(ckpt / "adapters.safetensors")
    assert stored and all(is_adapter_key(k) for k in stored)
    base = json.loads((ckpt / "adapters.json").read_text())["base"]
    assert base["path"] is None and base["init_seed"] == 1234 and len(base["sha256"]) == 64
    rc, _, err = cli("run", "--resume", part, "--no-progress")
    assert rc == 0, err
    assert _losses(part) == losses  # one thread, same data order, same adapter state: bit for bit


def test_plan_shows_the_adapters_and_the_values_it_filled(cli):
    rc, out, _ = cli("plan", "tiny-cpu", "peft.scheme=dora", "peft.targets=[self_attn.q_proj]")
    assert rc == 0
    assert "DORA rank 32 alpha 32" in out and "filled:" in out and "peft.rank = 32" in out
    rc, out, _ = cli("plan", "tiny-cpu", "peft.scheme=dora", "peft.targets=[self_attn.q_proj]", "--json")
    plan = json.loads(out)
    # tiny-cpu: 4 layers, q_proj 64 -> 64, rank 32: A 32 x 64 + B 64 x 32 + magnitude 64 per layer
    assert plan["adapter_params"] == 4 * (32 * 64 + 64 * 32 + 64)
    rc, _, err = cli("plan", "lora-64", "peft.targets=[self_attn.q_proj,mlp.router]")
    assert rc == 2 and "mlp.router" in err


@pytest.mark.slow
def test_tiny_cpu_trains_dora_on_the_attention_projections(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "dora"
    rc, _, err = cli("run", "tiny-cpu", "peft.scheme=dora", "peft.targets=[self_attn.q_proj,self_attn.v_proj]",
                     "peft.rank=4", "batch.gbs=2", "optimizer.warmup_steps=0", "--steps", "2", "--out", out,
                     "--no-progress")
    assert rc == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "completed"
    # the filled values are the ones the engine trained with
    assert results["engine_info"]["peft"]["filled"] == ["peft.alpha = 32.0", "peft.dropout = 0.0"]
    # 4 layers x (q: 64 -> 64, v: 64 -> 2 KV heads x 16 = 32), each A [4, in] + B [out, 4] + magnitude [out]
    assert results["engine_info"]["trainable_parameters"] == 4 * ((4 * 64 + 64 * 4 + 64) + (4 * 64 + 32 * 4 + 32))
