"""benchmarks/scripts/plan/host_sync_probe.py's ``--attention model`` (the probe itself needs a GPU and megatron-core):
each GQA model's own attention as TransformerConfig keywords, refused where it cannot be built."""

import pytest

from bench_results import script

probe = script("plan/host_sync_probe")
#: the TransformerConfig fields --attention model may set
FIELDS = {"num_attention_heads", "num_query_groups", "kv_channels", "qk_layernorm", "softmax_type", "add_bias_linear",
          "glu_linear_offset", "activation_func_clamp_value", "bias_activation_fusion", "activation_func",
          "window_size"}


def test_qwen3_gets_its_heads_query_groups_head_width_and_query_key_norms():
    kwargs, recorded = probe.model_attention(probe.model_shape("qwen3-235b-a22b", 8), "full", FIELDS)
    assert kwargs == {"num_attention_heads": 64, "num_query_groups": 4, "kv_channels": 128, "qk_layernorm": True}
    assert recorded == kwargs


def test_gpt_oss_gets_sinks_biases_its_experts_activation_and_on_a_sliding_layer_its_window():
    pytest.importorskip("megatron.core", reason="quick_gelu is megatron-core's")
    kwargs, recorded = probe.model_attention(probe.model_shape("gpt-oss-120b", 8), "sliding", FIELDS)
    assert kwargs["softmax_type"] == "learnable" and kwargs["window_size"] == (128, 0)
    assert kwargs["add_bias_linear"] and kwargs["bias_activation_fusion"] and kwargs["glu_linear_offset"] == 1.0
    assert recorded["activation_func"] == "quick_gelu" and (kwargs["num_attention_heads"], kwargs["kv_channels"]) == (64, 64)


@pytest.mark.parametrize(("model", "window", "fields", "message"), [
    ("deepseek-v3", "full", FIELDS, "has mla"),
    ("qwen3-30b-a3b", "sliding", FIELDS, "has no sliding window"),
    ("qwen3-30b-a3b", "full", FIELDS - {"qk_layernorm"}, "has no qk_layernorm"),
], ids=["mla", "no-window", "old-megatron-core"])
def test_what_cannot_be_built_is_refused_with_the_reason(model, window, fields, message):
    with pytest.raises(SystemExit, match=message):
        probe.model_attention(probe.model_shape(model, 8), window, fields)
