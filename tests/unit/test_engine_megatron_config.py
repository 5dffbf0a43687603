"""Recipe -> megatron-core TransformerConfig arguments (pure; no megatron-core needed)."""

from __future__ import annotations

import math

import pytest

from muse_stack.engines.mcore.config import pipeline_split, transformer_config_kwargs
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe


def kwargs(name: str, *overrides: str) -> dict:
    recipe = load_recipe(name, list(overrides))
    return transformer_config_kwargs(recipe, recipe.model_config_resolved())


def test_slice_layer_pattern_window_and_scale():
    kw = kwargs("slice-1gpu")
    assert kw["window_size"] == (2047, 0)  # 2048 keys per query counting the query itself
    assert kw["window_attn_skip_freq"] == [1, 0]  # layer 0 sliding, layer 1 full
    assert kw["no_rope_freq"] == [0, 1]  # NoPE on the full layer
    assert math.isclose(kw["softmax_scale"], 5.4730064863875 / 8)
    assert (kw["moe_latent_size"], kw["moe_ffn_hidden_size"], kw["num_moe_experts"], kw["moe_router_topk"]) == \
        (4096, 4096, 32, 8)
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0 and kw["moe_aux_loss_coeff"] == 0.0
    assert kw["moe_grouped_gemm"] and kw["moe_token_dispatcher_type"] == "allgather"
    assert kw["calculate_per_token_loss"] and kw["pipeline_dtype"] == "float32"
    assert kw["sequence_parallel"] is False and kw["recompute_granularity"] is None


def test_real_model_pattern_has_sixteen_full_layers():
    recipe = load_recipe("slice-1gpu", ["model.overrides.num_hidden_layers=62"])
    kw = transformer_config_kwargs(recipe, recipe.model_config_resolved())
    full = [i for i, s in enumerate(kw["window_attn_skip_freq"]) if s == 0]
    assert len(full) == 16 and all(i % 4 == 1 for i in full)
    assert kw["no_rope_freq"] == [1 - s for s in kw["window_attn_skip_freq"]]


def test_parallel_layout():
    kw = kwargs("proxy-2gpu", "layout.ep=1", "layout.tp=2", "recompute.granularity=full")
    assert kw["tensor_model_parallel_size"] == 2 and kw["sequence_parallel"] is True
    assert kw["recompute_granularity"] == "full" and kw["recompute_method"] == "uniform"
    kw = kwargs("proxy-2gpu")
    assert kw["expert_model_parallel_size"] == 2 and kw["cp_comm_type"] == "a2a"


def test_uneven_pipeline_stages():
    recipe = load_recipe("proxy-2gpu", ["layout.ep=1", "layout.pp=2", "layout.pp_layers=[1,3]"])
    assert pipeline_split(recipe, 4) == (1, 3)
    kw = transformer_config_kwargs(recipe, recipe.model_config_resolved())
    assert (kw["num_layers_in_first_pipeline_stage"], kw["num_layers_in_last_pipeline_stage"]) == (1, 3)
    bad = load_recipe("proxy-2gpu", ["layout.ep=1", "layout.pp=2", "layout.pp_layers=[1,2]"])
    with pytest.raises(RecipeError):
        pipeline_split(bad, 4)


def test_heads_must_split_over_tp():
    with pytest.raises(RecipeError):
        kwargs("proxy-2gpu", "layout.ep=1", "layout.tp=8")


def test_selective_recompute_modules_the_engine_implements():
    kw = kwargs("proxy-1gpu", "recompute.granularity=selective", "recompute.modules=[core_attn,moe_act]")
    assert kw["recompute_granularity"] == "selective" and kw["recompute_modules"] == ["core_attn", "moe_act"]
    assert "recompute_modules" not in kwargs("proxy-1gpu", "recompute.granularity=selective")  # megatron's default


def test_selective_recompute_refuses_modules_it_cannot_recompute():
    with pytest.raises(RecipeError) as err:
        kwargs("proxy-1gpu", "recompute.granularity=selective", "recompute.modules=[layernorm]")
    assert err.value.field == "recompute.modules" and "layernorm" in err.value.fix


def test_one_virtual_stage_is_plain_1f1b_and_interleaving_is_refused():
    assert kwargs("attune-b200")["virtual_pipeline_model_parallel_size"] is None  # the record's vpp 1
    with pytest.raises(RecipeError, match="interleaved") as exc:
        kwargs("proxy-2gpu", "layout.ep=1", "layout.pp=2", "layout.vpp=2")
    assert exc.value.field == "layout.vpp"
