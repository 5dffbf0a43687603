"""The toy Muse Spark configuration the model tests share."""

from __future__ import annotations

from muse_stack.model_config import ModelConfig

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, moe_hidden_size=16, num_local_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, sliding_window=4)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig().with_overrides(**{**TINY, **overrides})
