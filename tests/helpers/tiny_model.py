"""The toy Muse Spark configuration the model tests share."""

from __future__ import annotations

import contextlib

import torch

from muse_stack.models.muse_spark.config import ModelConfig

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, moe_hidden_size=16, num_local_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, sliding_window=4)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig().with_overrides(**{**TINY, **overrides})


#: float32 unit roundoff
FP32_U = 2.0**-24


def fp32_sum_bound(n: int, magnitude: float) -> float:
    """Higham's bound for a float32 result built from n roundings in sequence (sums of n terms,
    or a chain of operations n roundings long): |error| <= n u / (1 - n u) * sum of |terms|, the
    sum of |terms| bounded by ``magnitude``. A bound for any summation order, so for any machine,
    thread count or blocking."""
    return n * FP32_U / (1 - n * FP32_U) * magnitude


def logits_rounding_chain(config: ModelConfig, tokens: int) -> int:
    """Roundings on the longest path from the embedding to a logit of the reference decoder: per
    layer the norms and projections over H, the scores over head_dim, the softmax and values over
    the keys, the output projection, the latent MoE (router and projections over H, the expert over
    Hm and I, the top-k sum), and at the end the final norm and the output projection."""
    h, hm, i = config.hidden_size, config.moe_hidden_size, config.moe_intermediate_size
    per_layer = (6 * h  # input / post-attention / pre- and post-feedforward norms, q/k/v/gate, latent down and router
                 + config.head_dim + 2 * tokens  # scores, softmax sum, weighted values
                 + config.num_attention_heads * config.head_dim  # output projection
                 + 4 * hm + i + config.num_experts_per_tok)  # expert norms, gate_up, down, latent up; top-k sum
    return config.num_hidden_layers * per_layer + 2 * h


def logits_tolerance(config: ModelConfig, tokens: int) -> float:
    """Absolute float32 tolerance for two computations of the same logits that differ only in
    summation order (batching, blocking, masking): the rounding chain's bound at the largest
    logit, which the softcap bounds."""
    return fp32_sum_bound(logits_rounding_chain(config, tokens), config.final_logit_softcapping)


def attention_output_bound(attn, config: ModelConfig, tokens: int, extra_roundings: int = 0) -> float:
    """Absolute float32 bound for an attention layer's output computed two ways that differ only
    in rounding: n u / (1 - n u) x S. n is the layer's rounding chain (q/k/v/gate projections over
    H, the per-head norms over head_dim, scores, softmax sum and values over the keys, the output
    projection over heads x head_dim) plus ``extra_roundings``; the normalisations pass relative
    error through to first order, so the roundings add. S bounds the sum of |terms| of the output
    projection: each normalised, gated head entry is at most sqrt(head_dim) in size (its rms is 1)
    times the largest row sum of |W_o|."""
    d = config.head_dim
    n = 2 * config.hidden_size + 2 * d + 2 * tokens + config.num_attention_heads * d + extra_roundings
    w_o = attn.o_proj.weight.detach().abs().sum(dim=1).max().item()
    return fp32_sum_bound(n, d**0.5 * w_o)


@contextlib.contextmanager
def float64_throughout():
    """transformers' Muse Spark casts to float32 inside its norms (``hidden_states.float()``) and its
    router (``.type(torch.float32)``); inside this context those casts leave float64 tensors as they
    are, so transformers' model and ours run the same formulas in float64 and any difference
    between them is rounding (or a formula error, which the negative controls show a bound catches)."""
    as_float, as_type = torch.Tensor.float, torch.Tensor.type

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else as_float(self, *args, **kwargs)

    def type_(self, dtype=None, *args, **kwargs):
        if dtype is torch.float32 and self.dtype == torch.float64:
            return self
        return as_type(self, dtype, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.type = float_, type_
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.type = as_float, as_type
