"""The megatron-core <-> Hugging Face weight-name mapping and tensor-parallel sharding (CPU)."""

from __future__ import annotations

import pytest
import torch

from muse_stack.engines.mcore.weights import (
    Target,
    hf_to_mcore,
    local_to_global,
    mcore_to_hf,
    shard,
)
from muse_stack.models.muse_spark import MuseSparkForCausalLM
from muse_stack.models.muse_spark.config import ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, moe_hidden_size=16, num_local_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=8, first_padding_token_id=None)


def reference_names(cfg: ModelConfig) -> set[str]:
    with torch.device("meta"):
        model = MuseSparkForCausalLM(cfg, seed=None)
    return set(model.state_dict())


def test_every_checkpoint_tensor_maps_one_to_one():
    names = reference_names(TINY)
    mcore = [m for hf in sorted(names) for m in hf_to_mcore(hf, TINY.num_local_experts)]
    assert len(mcore) == len(set(mcore)), "two checkpoint tensors map to one megatron-core tensor"
    back = {mcore_to_hf(m).hf_name for m in mcore}
    assert back == names
    per_layer = 16 + 2 * TINY.num_local_experts
    assert len(mcore) == 3 + TINY.num_hidden_layers * per_layer


@pytest.mark.parametrize("mc, hf", [
    ("embedding.word_embeddings.weight", "model.language_model.embed_tokens.weight"),
    ("output_layer.weight", "lm_head.weight"),
    ("decoder.final_layernorm.weight", "model.language_model.norm.weight"),
    ("decoder.layers.2.self_attention.linear_gate.weight", "model.language_model.layers.2.self_attn.gate_proj.weight"),
    ("decoder.layers.0.self_attention.linear_proj.weight", "model.language_model.layers.0.self_attn.o_proj.weight"),
    ("decoder.layers.1.mlp.router.expert_bias", "model.language_model.layers.1.mlp.gate.e_score_correction_bias"),
    ("decoder.layers.1.mlp.fc1_latent_proj.weight", "model.language_model.layers.1.mlp.pre_expert_proj.weight"),
    ("decoder.layers.1.mlp.fc2_latent_proj.weight", "model.language_model.layers.1.mlp.post_expert_proj.weight"),
    ("decoder.layers.1.post_mlp_layernorm.weight", "model.language_model.layers.1.post_feedforward_layernorm.weight"),
])
def test_named_pairs(mc, hf):
    assert mcore_to_hf(mc).hf_name == hf


def test_expert_weights_index_the_stacked_tensor():
    t = mcore_to_hf("decoder.layers.4.mlp.experts.linear_fc1.weight7")
    assert t == Target("model.language_model.layers.4.mlp.experts.gate_up_proj", expert=7, etp_axis=0, glu=True)
    t = mcore_to_hf("decoder.layers.4.mlp.experts.linear_fc2.weight0")
    assert (t.hf_name, t.expert, t.etp_axis, t.glu) == ("model.language_model.layers.4.mlp.experts.down_proj", 0, 1, False)


def test_local_names_of_a_pipeline_stage_and_expert_rank():
    assert local_to_global("decoder.layers.0.mlp.experts.linear_fc1.weight3", 9, 32) == \
        "decoder.layers.9.mlp.experts.linear_fc1.weight35"
    assert local_to_global("decoder.layers.2.input_layernorm.weight", 9, 32) == "decoder.layers.11.input_layernorm.weight"
    assert local_to_global("output_layer.weight", 9, 32) == "output_layer.weight"


def test_unknown_names_are_rejected():
    with pytest.raises(KeyError):
        mcore_to_hf("decoder.layers.0.self_attention.linear_qkv.weight")
    with pytest.raises(KeyError):  # a fused name the decoder does not have
        hf_to_mcore("model.language_model.layers.0.self_attn.qkv_proj.weight", 4)
    with pytest.raises(KeyError):  # under model. but no perception module (the towers map: test_media_placement)
        hf_to_mcore("model.multi_modal_projector.weight", 4)


def test_tensor_parallel_shards():
    w = torch.arange(8 * 6).reshape(8, 6)
    q = mcore_to_hf("decoder.layers.0.self_attention.linear_q.weight")
    assert torch.equal(shard(w, q, 1, 2, 0, 1), w[4:])
    o = mcore_to_hf("decoder.layers.0.self_attention.linear_proj.weight")
    assert torch.equal(shard(w, o, 1, 2, 0, 1), w[:, 3:])
    norm = mcore_to_hf("decoder.layers.0.input_layernorm.weight")
    assert torch.equal(shard(w, norm, 1, 2, 0, 1), w)
    with pytest.raises(ValueError):
        shard(torch.zeros(5, 2), q, 0, 2, 0, 1)


def test_expert_tensor_parallel_splits_gate_and_up_alike():
    gate, up = torch.full((4, 3), 1.0), torch.full((4, 3), 2.0)
    gate[2:] = 3.0
    fc1 = mcore_to_hf("decoder.layers.0.mlp.experts.linear_fc1.weight0")
    part = shard(torch.cat([gate, up]), fc1, 0, 1, 1, 2)  # ETP rank 1 of 2; TP does not split experts
    assert torch.equal(part, torch.cat([gate[2:], up[2:]]))
