"""The decoder on a CUDA device: same logits as on CPU, bf16 autocast and bf16 weights train,
initialisation on the device is deterministic, checkpoints load onto the device."""

from __future__ import annotations

import pytest
import torch

from muse_stack.models.muse_spark import MuseSparkForCausalLM, load_checkpoint, save_checkpoint, shift_labels
from muse_stack.models.muse_spark.config import ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_hidden_size=32, num_local_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, sliding_window=16)


def small_config() -> ModelConfig:
    return ModelConfig().with_overrides(**SMALL)


def data(rows: int = 4, length: int = 64):
    ids = torch.randint(0, 512, (rows, length), generator=torch.Generator().manual_seed(0))
    labels, mask = shift_labels(ids)
    return ids, labels, mask


def test_cuda_fp32_matches_cpu():
    model = MuseSparkForCausalLM(small_config(), seed=0)
    ids, _, _ = data()
    cpu = model(ids, cu_seqlens=[0, 30, 64, 100, 256]).logits
    gpu = model.cuda()(ids.cuda(), cu_seqlens=[0, 30, 64, 100, 256]).logits
    # fp32 on both (torch leaves TF32 off for matmuls): each side within the float32 rounding bound
    # of the exact logits (tiny_model.logits_tolerance: chain of 3,880 roundings x 20), so within
    # twice it (9.3e-3) of each other
    from tiny_model import logits_tolerance

    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=2 * logits_tolerance(model.config, 156))


def test_cuda_bf16_autocast_and_bf16_weights_train():
    torch.manual_seed(0)
    ids, labels, mask = (t.cuda() for t in data())
    reference = MuseSparkForCausalLM(small_config(), seed=0).cuda()
    ref_loss = reference(ids, labels=labels, loss_mask=mask).loss.item()
    for bf16_weights in (False, True):
        model = MuseSparkForCausalLM(small_config(), seed=0).cuda()
        if bf16_weights:
            model = model.to(torch.bfloat16)
            assert model.model.language_model.layers[0].mlp.gate.weight.dtype == torch.float32
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids, labels=labels, loss_mask=mask)
            assert out.logits.dtype == torch.float32
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out.loss.item())
        assert abs(losses[0] - ref_loss) < 0.05
        assert losses[-1] < losses[0] - 0.5


def test_init_on_device_is_deterministic():
    with torch.device("cuda"):
        a = MuseSparkForCausalLM(small_config(), seed=5)
        b = MuseSparkForCausalLM(small_config(), seed=5)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert x.is_cuda and torch.equal(x, y), name


def test_load_checkpoint_onto_device(tmp_path):
    model = MuseSparkForCausalLM(small_config(), seed=0)
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16, device="cuda")
    sd = loaded.state_dict()
    assert all(t.is_cuda for t in sd.values())
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    assert sd["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float32
    ids, _, _ = data(rows=1)
    assert torch.isfinite(loaded(ids.cuda()).logits).all()
