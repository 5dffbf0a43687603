"""The Muse Spark layer spec: megatron-core / Transformer Engine modules composed by ModuleSpec."""

from __future__ import annotations

from functools import partial

from megatron.core.extensions.transformer_engine import (
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TEDotProductAttention,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from muse_stack.engines.mcore.layers import (
    AttentionSubmodules,
    LayerSubmodules,
    MuseSparkAttention,
    MuseSparkExperts,
    MuseSparkLayer,
    MuseSparkMoE,
    MuseSparkRouter,
)


def muse_spark_layer_spec() -> ModuleSpec:
    """One decoder layer: attention with output gate, latent MoE with grouped-GEMM experts."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl  # noqa: F401 - checks the fusion imports

    attention = ModuleSpec(
        module=MuseSparkAttention,
        submodules=AttentionSubmodules(
            linear_q=TEColumnParallelLinear, linear_k=TEColumnParallelLinear, linear_v=TEColumnParallelLinear,
            linear_gate=TEColumnParallelLinear, core_attention=TEDotProductAttention,
            linear_proj=TERowParallelLinear))
    experts = partial(MuseSparkExperts, submodules=GroupedMLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
    mlp = ModuleSpec(module=MuseSparkMoE, submodules=MoESubmodules(experts=experts, router=MuseSparkRouter))
    return ModuleSpec(module=MuseSparkLayer, submodules=LayerSubmodules(self_attention=attention, mlp=mlp))
