"""The real model's parameter shapes (built on the meta device) against the notes' counts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from muse_stack.models.muse_spark import MuseSparkForCausalLM
from muse_stack.models.muse_spark.config import MUSE_SPARK_OPEN


def category(name: str) -> str:
    if "self_attn." in name:
        return "attention"
    if name.endswith(("pre_expert_proj.weight", "post_expert_proj.weight")):
        return "latent"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return "experts"
    if name == "model.language_model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "output"
    if name == "model.language_model.norm.weight":
        return "final_norm"
    return "norm"


@pytest.fixture(scope="module")
def real():
    with torch.device("meta"):
        return MuseSparkForCausalLM(MUSE_SPARK_OPEN)


def test_real_model_parameter_counts(real):
    cfg = MUSE_SPARK_OPEN
    totals: Counter[str] = Counter()
    for name, param in real.named_parameters():
        assert param.is_meta
        totals[category(name)] += param.numel()
    layers = cfg.num_hidden_layers
    assert totals["attention"] == layers * cfg.attention_params == layers * 218_103_808
    assert totals["latent"] == layers * cfg.latent_projection_params == layers * 67_108_864
    assert totals["router"] == layers * cfg.router_params == layers * 2_097_152
    assert totals["experts"] == layers * cfg.num_local_experts * cfg.expert_params
    assert cfg.expert_params == 50_331_648
    assert totals["norm"] == layers * cfg.norm_params_per_layer
    assert totals["embedding"] == totals["output"] == 202048 * 8192
    per_layer_active = (totals["attention"] + totals["latent"] + totals["router"]) // layers \
        + cfg.num_experts_per_tok * totals["experts"] // (layers * cfg.num_local_experts)
    assert per_layer_active == cfg.active_params_per_layer == 689_963_008
    assert layers * per_layer_active + totals["output"] == cfg.active_params == 44_432_883_712
    assert sum(totals.values()) == cfg.total_params


def test_real_model_shapes_and_pattern(real):
    shapes = {name: tuple(t.shape) for name, t in real.state_dict().items()}
    p = "model.language_model.layers.5."
    assert shapes[p + "self_attn.q_proj.weight"] == (8192, 8192)
    assert shapes[p + "self_attn.k_proj.weight"] == (1024, 8192)
    assert shapes[p + "self_attn.gate_proj.weight"] == (8192, 8192)
    assert shapes[p + "mlp.gate.weight"] == (256, 8192)
    assert shapes[p + "mlp.gate.e_score_correction_bias"] == (256,)
    assert shapes[p + "mlp.experts.gate_up_proj"] == (256, 8192, 4096)
    assert shapes[p + "mlp.experts.down_proj"] == (256, 4096, 4096)
    assert shapes[p + "mlp.pre_expert_proj.weight"] == (4096, 8192)
    assert shapes[p + "mlp.post_expert_proj.weight"] == (8192, 4096)
    assert real.state_dict()[p + "mlp.gate.weight"].dtype == torch.float32
    layers = real.model.language_model.layers
    full = [i for i, layer in enumerate(layers) if layer.self_attn.window is None]
    assert full == [i for i in range(62) if i % 4 == 1] and len(full) == 16
    assert all(layers[i].self_attn.use_rope != (i in full) for i in range(62))
    assert {layers[i].self_attn.window for i in range(62) if i not in full} == {2048}
