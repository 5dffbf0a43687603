"""Muse Spark modules on megatron-core: what its config switches do not express.

Composed from megatron-core and Transformer Engine modules (see :mod:`.spec`):

* :class:`MuseSparkAttention` -- q/k/v/gate as ``TEColumnParallelLinear``, the weightless QK
  norm, rotate-half RoPE (megatron-core's fused kernel) on sliding layers only,
  ``TEDotProductAttention`` (cuDNN fused attention, sliding window from
  ``window_size``/``window_attn_skip_freq``, scale ``qk_scale_factor / sqrt(d)``, context
  parallelism), then ``o = rms(o) * sigmoid(g)`` per head and ``TERowParallelLinear``.
* :class:`MuseSparkRouter` -- megatron-core's ``TopKRouter`` (sigmoid scores, selection-only
  expert bias, renormalised top-k weights) with the logit multiplier and an fp32 weight.
* :class:`MuseSparkMoE` -- megatron-core's ``MoELayer`` with ``moe_latent_size`` (its
  ``fc1_latent_proj``/``fc2_latent_proj`` are the pre/post expert projections), plus the
  pre-expert norm on the latent before dispatch. Its allgather dispatcher reads the experts'
  token counts before the latent GEMM where no tokens move (:mod:`.dispatch`).
* :class:`MuseSparkExperts` -- ``TEGroupedMLP`` (grouped GEMM SwiGLU experts) whose output gets
  the post-expert norm per expert slot *before* the routing weight is applied (the norm is
  not linear, so the weight cannot be folded into the activation as megatron-core does). Its
  SwiGLU is megatron-core's compiled forward with TE's ``dswiglu`` backward
  (:class:`SwiGLUTEBackward`); under the step's first micro-batch writes
  (:mod:`.first_write`) an expert with no token has its gradients zeroed here.
* :class:`MuseSparkLayer` -- the decoder layer: pre-norms with centred gains, post-norms,
  gated residuals on an fp32 residual stream.
* :class:`MuseSparkBlock` -- the layers of one pipeline stage (uneven first/last stages via
  megatron-core's layer offsets), full recompute, the final norm.

Norms follow :mod:`muse_stack.models.muse_spark.norms` exactly; they run in fp32 and hand the parameters'
dtype to the matmuls (bf16; fp32 with ``precision: fp32``, :func:`set_matmul_dtype`). The
recipe's ``engine_options.compile_elementwise`` fuses the elementwise chains with
``torch.compile`` (:mod:`muse_stack.engines.mcore.fuse`); the chains are in
:mod:`muse_stack.engines.mcore.chains`.
"""

from __future__ import annotations

from contextlib import nullcontext

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from muse_stack.engines.mcore.chains import (
    centered_norm,
    gain_first_norm,
    gated_residual,
    output_gate,
    post_attention_residual,
    post_attention_residual_and_norm,
    qk_norm,
    set_matmul_dtype,
    softcap_logits,
    stored_gain_norm,
    weighted_gain_first_norm,
)
from muse_stack.engines.mcore.dispatch import EarlyCountAllGatherDispatcher
from muse_stack.engines.mcore import norm_backward
from muse_stack.engines.mcore.first_write import module_weights, zero_unrouted
from muse_stack.models.muse_spark.residual import initial_gate_value
from muse_stack.models.muse_spark.config import ModelConfig


# ---- parameters -----------------------------------------------------------------------
def _fp32_param(size: int, value: float, sequence_parallel: bool) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.full((size,), value, dtype=torch.float32, device=torch.cuda.current_device()))
    # seen by each TP rank on its own tokens under sequence parallelism: reduce over TP
    setattr(p, "sequence_parallel", sequence_parallel)
    return p


class _Norm(torch.nn.Module):
    """A norm with an fp32 gain ``weight`` (initialised to ``init``) and its function ``fn``."""

    init: float = 0.0
    fn = None

    def __init__(self, size: int, eps: float, sequence_parallel: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _fp32_param(size, self.init, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return type(self).fn(x, self.weight, self.eps)


class CenteredNorm(_Norm):
    """rms(x) * (1 + weight); weight stored centred at 0 (fp32)."""

    fn = staticmethod(centered_norm)


class GainFirstNorm(_Norm):
    """rms(x * (1 + weight)) (fp32)."""

    fn = staticmethod(gain_first_norm)


class StoredGainNorm(_Norm):
    """rms(x) * weight, weight used as stored (the final norm)."""

    init = 1.0
    fn = staticmethod(stored_gain_norm)


class ResidualGate(torch.nn.Module):
    """Holds ``gate`` (checkpoint ``...residual_gate.gate``)."""

    def __init__(self, size: int, temperature: float, num_layers: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.temperature = temperature
        self.gate = _fp32_param(size, initial_gate_value(num_layers, temperature), sequence_parallel)


# ---- attention ------------------------------------------------------------------------
@dataclass
class AttentionSubmodules:
    linear_q: Any
    linear_k: Any
    linear_v: Any
    linear_gate: Any
    core_attention: Any
    linear_proj: Any


class MuseSparkAttention(MegatronModule):
    def __init__(self, config, submodules: AttentionSubmodules, layer_number: int, muse: ModelConfig,
                 pg_collection=None) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.heads = config.num_attention_heads // tp
        self.kv_heads = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.eps = muse.rms_norm_eps
        self.use_rope = not config.no_rope_freq[layer_number - 1] if config.no_rope_freq else True
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        q_width, kv_width = config.num_attention_heads * self.head_dim, config.num_query_groups * self.head_dim
        common = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                      skip_bias_add=False, is_expert=False, tp_group=pg_collection.tp if pg_collection else None)
        self.linear_q = build_module(submodules.linear_q, config.hidden_size, q_width, tp_comm_buffer_name="q", **common)
        self.linear_k = build_module(submodules.linear_k, config.hidden_size, kv_width, tp_comm_buffer_name="k", **common)
        self.linear_v = build_module(submodules.linear_v, config.hidden_size, kv_width, tp_comm_buffer_name="v", **common)
        self.linear_gate = build_module(submodules.linear_gate, config.hidden_size, q_width, tp_comm_buffer_name="gate",
                                        **common)
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
            attention_type="self", softmax_scale=config.softmax_scale, cp_comm_type=config.cp_comm_type,
            pg_collection=pg_collection)
        self.linear_proj = build_module(
            submodules.linear_proj, q_width, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="proj",
            tp_group=pg_collection.tp if pg_collection else None)
        self.recompute_core = (config.recompute_granularity == "selective"
                               and "core_attn" in (config.recompute_modules or []))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        return self.core_attention(q, k, v, attention_mask=None, attn_mask_type=AttnMaskType.causal,
                                   packed_seq_params=packed_seq_params)

    def forward(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor | None, packed_seq_params=None) -> torch.Tensor:
        """``x`` [s, b, H]; with ``packed_seq_params`` (THD) b is 1 and s holds every packed
        sequence back to back: RoPE restarts per sequence and attention stays inside each."""
        q, _ = self.linear_q(x)
        k, _ = self.linear_k(x)
        v, _ = self.linear_v(x)
        g, _ = self.linear_gate(x)
        s, b = q.shape[0], q.shape[1]
        thd = packed_seq_params is not None
        shape = (s * b,) if thd else (s, b)  # THD: [tokens, heads, dim]
        q = qk_norm(q.view(*shape, self.heads, self.head_dim), self.eps)
        k = qk_norm(k.view(*shape, self.kv_heads, self.head_dim), self.eps)
        v = v.view(*shape, self.kv_heads, self.head_dim)
        if self.use_rope and rotary_pos_emb is not None:
            cu = packed_seq_params.cu_seqlens_q_padded if thd else None
            q = apply_rotary_pos_emb(q, rotary_pos_emb, config=self.config, cu_seqlens=cu, cp_group=self.cp_group)
            k = apply_rotary_pos_emb(k, rotary_pos_emb, config=self.config, cu_seqlens=cu, cp_group=self.cp_group)
        if self.recompute_core:
            # non-tensor arguments cannot pass through the checkpoint: bind them
            o = tensor_parallel.checkpoint(partial(self._core, packed_seq_params=packed_seq_params), False, q, k, v)
        else:
            o = self._core(q, k, v, packed_seq_params)
        o = output_gate(o.view(s, b, self.heads, self.head_dim), g.view(s, b, self.heads, self.head_dim), self.eps)
        out, _ = self.linear_proj(o.view(s, b, self.heads * self.head_dim))
        return out


# ---- mixture of experts ---------------------------------------------------------------
class MuseSparkRouter(TopKRouter):
    """TopKRouter with ``logits x output_multiplier`` and the weight kept in fp32."""

    output_multiplier: float = 1.0

    def reset_parameters(self) -> None:
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
        self.weight.data = self.weight.data.to(dtype=torch.float32)
        setattr(self.weight, "sequence_parallel", self.config.sequence_parallel)

    def gating(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - megatron-core's signature
        # fp32 matmul of fp32 weight and upcast input, as the reference router
        return torch.nn.functional.linear(input.float(), self.weight.float()) * self.output_multiplier


class SwiGLUTEBackward(torch.autograd.Function):
    """``silu(first half) * second half`` by megatron-core's compiled ``swiglu`` (the forward of its
    ``bias_swiglu_impl``); the backward by Transformer Engine's ``dswiglu`` kernel (the backward of
    its ``ops.SwiGLU``), which reads the input and the gradient once each and writes both halves'
    gradients. Both compute in fp32 and round once to the input's dtype. Measured alone at the
    slice's shape (benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/kernels.json): megatron-core's forward is the faster
    forward, TE's backward the faster backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - torch.autograd.Function
        from megatron.core.fusions.fused_bias_swiglu import swiglu

        ctx.save_for_backward(x)
        return swiglu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        import transformer_engine_torch as tex

        (x,) = ctx.saved_tensors
        return tex.dswiglu(grad.contiguous(), x, None)


class MuseSparkExperts(TEGroupedMLP):
    """Grouped-GEMM SwiGLU experts; post-expert norm per slot, then the routing weight.

    Under expert tensor parallelism (ETP > 1) each ETP rank's row-parallel ``linear_fc2`` yields
    a partial sum that the dispatcher's combine reduce-scatters. The norm is not linear, so the
    partial sums are all-reduced first (autograd-aware: the backward sums the gradients too),
    normed and weighted, and divided by ETP so that the combine's sum restores the value.
    """

    post_norm_eps: float = 1e-8
    # Set by the engine from the recipe's engine options when it builds the model (each install_* function,
    # muse_stack/recipes/options.py); a module no engine installed has none of them.
    #: ``engine_options.unweighted_swiglu``: the SwiGLU between the two grouped GEMMs carries no routing
    #: weight (the weight comes after the post-expert norm), so it runs megatron-core's unweighted fused
    #: SwiGLU. Its weighted one, given ones, also reduces a gradient for those ones that nothing reads.
    #: False: the weighted one with ones (the engine before)
    unweighted_swiglu: bool
    #: ``engine_options.te_swiglu_backward``: that SwiGLU's backward as Transformer Engine's ``dswiglu``
    #: kernel (:class:`SwiGLUTEBackward`; the forward is megatron-core's either way). False: megatron-core's
    #: compiled backward, one kernel that computes each output element's half of the concatenated gradient
    #: on its own
    te_swiglu_backward: bool
    #: ``engine_options.one_pass_norm_backward``: the post-expert norm's backward as one Triton pass over its
    #: input (:mod:`.norm_backward`, which installs it). False: the compiled chain's own backward,
    #: TorchInductor's row pass and a column sum that reads the input again
    fused_norm_backward: bool

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None, name=None) -> None:
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        self.post_expert_norm = GainFirstNorm(config.moe_latent_size, self.post_norm_eps, False)
        self.etp_group = pg_collection.expt_tp if pg_collection is not None else None
        self.etp = self.etp_group.size() if self.etp_group is not None else 1

    def _plain_swiglu(self) -> bool:
        """fc1, SwiGLU, fc2 and nothing else in megatron-core's forward (under FP8 between its padding of each
        expert's rows to the GEMM multiple and the unpadding): no FP4, no recompute or offload of the activation,
        no TE op fuser, no probabilities on the input."""
        c = self.config
        return (self.unweighted_swiglu and not self._with_fused_impl and not c.fp4
                and not self.activation_recompute and not c.moe_apply_probs_on_input
                and not getattr(self, "offload_expert_fc1", False) and not getattr(self, "offload_moe_act", False)
                and c.gated_linear_unit and c.bias_activation_fusion and not c.use_te_activation_func
                and c.moe_mlp_glu_interleave_size is None)

    def one_pass_norm_backward(self) -> bool:
        """Whether the post-expert norm's backward runs as one Triton pass (the option on, Triton present)."""
        return self.fused_norm_backward and norm_backward.available()

    def _experts(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        counts = tokens_per_expert.tolist()
        # under the step's first micro-batch writes: the experts with no token get zero gradients
        zero_unrouted(module_weights(self.linear_fc1), module_weights(self.linear_fc2), counts)
        if not self._plain_swiglu():
            return super().forward(hidden, tokens_per_expert, torch.ones_like(permuted_probs))
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
        from megatron.core.transformer.moe.moe_utils import skip_routed_expert_padding

        # FP8: each expert's rows padded with zero rows to the GEMM multiple where the router did not pad them
        # (megatron-core's padding modules, as its forward does); SwiGLU(0) = 0 and the pad rows are dropped after fc2
        pad = bool(self.config.fp8) and not skip_routed_expert_padding(self.config)
        gemm_counts = counts
        if pad:
            hidden, gemm_counts = self.quantization_padding(hidden, counts)
        fc1, fc1_bias = self.linear_fc1(hidden, gemm_counts)
        act = (SwiGLUTEBackward.apply(fc1) if self.te_swiglu_backward and fc1_bias is None and fc1.dim() == 2
               else bias_swiglu_impl(fc1, fc1_bias))
        out, bias = self.linear_fc2(act, gemm_counts)
        if pad:
            out = self.quantization_unpadding(out, counts)
        return out, bias

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor,
                **kwargs: Any):
        out, bias = self._experts(hidden, tokens_per_expert, permuted_probs)
        if self.etp > 1:  # whole outputs to norm; the weight divided by ETP, restored by the combine's sum
            from torch.distributed.nn.functional import all_reduce

            out = all_reduce(out, group=self.etp_group)
            permuted_probs = permuted_probs / self.etp
        norm = self.post_expert_norm
        if self.one_pass_norm_backward() and out.dim() == 2:
            return norm_backward.weighted_gain_first_norm(out.to(hidden.dtype), norm.weight, permuted_probs,
                                                          norm.eps), bias
        return weighted_gain_first_norm(out.to(hidden.dtype), norm.weight, permuted_probs, norm.eps), bias


class MuseSparkMoE(MoELayer):
    """MoELayer with latent projections and the pre-expert norm on the latent."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, muse: ModelConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        assert muse is not None
        self.router.output_multiplier = muse.output_multiplier
        self.experts.post_expert_norm.eps = muse.post_norm_eps
        self.pre_expert_norm = CenteredNorm(config.moe_latent_size, muse.rms_norm_eps, config.sequence_parallel)
        if type(self.token_dispatcher) is MoEAllGatherTokenDispatcher:  # the counts read before the latent GEMM
            self.token_dispatcher = EarlyCountAllGatherDispatcher(self.num_local_experts, self.local_expert_indices,
                                                                  config=config, pg_collection=pg_collection)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        if isinstance(self.token_dispatcher, EarlyCountAllGatherDispatcher):
            self.token_dispatcher.prefetch_counts(routing_map)
        latent, _ = self.fc1_latent_proj(hidden_states)
        latent = self.pre_expert_norm(latent)
        return self.token_dispatcher.dispatch_preprocess(latent, routing_map, probs)


# ---- decoder layer and block ----------------------------------------------------------
@dataclass
class LayerSubmodules:
    self_attention: Any
    mlp: Any


class MuseSparkLayer(MegatronModule):
    """One decoder layer on the fp32 residual stream [s, b, H]."""

    #: ``engine_options.fused_pre_mlp_norm``, set by the engine when it builds the model
    #: (:func:`install_fused_pre_mlp_norm`): the post-attention residual and the pre-MLP norm as one chain
    #: (:func:`post_attention_residual_and_norm`). False: two chains, the norm through its module (the engine
    #: before)
    fused_pre_mlp_norm: bool

    def __init__(self, config, submodules: LayerSubmodules, layer_number: int, muse: ModelConfig,
                 pg_collection=None, vp_stage=None) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number  # global, 1-based
        sp = config.sequence_parallel
        h, eps, post_eps, t = config.hidden_size, muse.rms_norm_eps, muse.post_norm_eps, muse.residual_gate_temperature
        self.post_eps, self.temperature = post_eps, t
        self.input_layernorm = CenteredNorm(h, eps, sp)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number,
                                           muse=muse, pg_collection=pg_collection)
        self.post_attention_residual_gate = ResidualGate(h, t, muse.num_hidden_layers, sp)
        self.pre_mlp_layernorm = CenteredNorm(h, eps, sp)
        self.mlp = build_module(submodules.mlp, config=config, layer_number=layer_number, pg_collection=pg_collection,
                                muse=muse)
        self.post_mlp_layernorm = GainFirstNorm(h, post_eps, sp)
        self.post_mlp_residual_gate = ResidualGate(h, t, muse.num_hidden_layers, sp)

    def forward(self, stream: torch.Tensor, rotary_pos_emb: torch.Tensor | None, packed_seq_params=None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(stream), rotary_pos_emb, packed_seq_params)
        gate = self.post_attention_residual_gate.gate
        if self.fused_pre_mlp_norm:
            norm = self.pre_mlp_layernorm
            stream, normed = post_attention_residual_and_norm(stream, attn, gate, self.post_eps, self.temperature,
                                                              norm.weight, norm.eps)
        else:
            stream = post_attention_residual(stream, attn, gate, self.post_eps, self.temperature)
            normed = self.pre_mlp_layernorm(stream)
        ffn, _ = self.mlp(normed)
        return gated_residual(stream, self.post_mlp_layernorm(ffn), self.post_mlp_residual_gate.gate, self.temperature)


class MuseSparkBlock(MegatronModule):
    """The decoder layers of this pipeline stage, and the final norm on the last stage."""

    def __init__(self, config, layer_spec: ModuleSpec, muse: ModelConfig, pre_process: bool, post_process: bool,
                 pg_collection=None, pp_rank: int = 0, vp_stage: int | None = None) -> None:
        super().__init__(config=config)
        self.pre_process, self.post_process = pre_process, post_process
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        self.layer_offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        layers = []
        for i in range(count):
            with _quantization(config, self.layer_offset + i, is_init=True):
                layers.append(build_module(layer_spec, config=config, layer_number=self.layer_offset + i + 1,
                                           muse=muse, pg_collection=pg_collection))
        self.layers = torch.nn.ModuleList(layers)
        self.final_layernorm = StoredGainNorm(config.hidden_size, muse.rms_norm_eps, config.sequence_parallel) \
            if post_process else None
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def _run(self, start: int, end: int, packed_seq_params=None):
        per_layer = self.config.fp8 and self.config.fp8_recipe != "delayed"

        def fn(stream: torch.Tensor, rotary: torch.Tensor | None) -> torch.Tensor:
            for layer in self.layers[start:end]:
                with _quantization(self.config, layer.layer_number - 1) if per_layer else nullcontext():
                    stream = layer(stream, rotary, packed_seq_params)
            return stream

        return fn

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Dist-checkpoint keys name layers by their global number (``layers.{global}.``), so that
        every pipeline stage writes its own layers and any split reads them back."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import sharded_state_dict_default

        assert not sharded_offsets, "the block is not sharded by its parent"
        out = {}
        for i, layer in enumerate(self.layers):
            local, global_ = f"{prefix}layers.{i}.", f"{prefix}layers.{layer.layer_number - 1}."
            sub = layer.sharded_state_dict(local, (), metadata)
            replace_prefix_for_sharding(sub, local, global_)
            out.update(sub)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", (), metadata))
        return out

    def forward(self, stream: torch.Tensor | None, rotary_pos_emb: torch.Tensor | None,
                packed_seq_params=None) -> torch.Tensor:
        if not self.pre_process:
            stream = self.input_tensor
        cfg = self.config
        n = len(self.layers)
        # FP8 as megatron-core's TransformerBlock applies it: delayed scaling around the whole pass
        # (one amax history update per step), the other recipes per layer (inside _run)
        with _quantization(cfg) if cfg.fp8 and cfg.fp8_recipe == "delayed" else nullcontext():
            stream = self._layers(stream, rotary_pos_emb, packed_seq_params, n)
        if self.final_layernorm is not None:
            return self.final_layernorm(stream)
        return stream

    def _layers(self, stream, rotary_pos_emb, packed_seq_params, n: int):
        cfg = self.config
        if cfg.recompute_granularity == "full" and self.training:
            k = cfg.recompute_num_layers or 1
            if cfg.recompute_method == "block":
                for i in range(n):
                    fn = self._run(i, i + 1, packed_seq_params)
                    stream = tensor_parallel.checkpoint(fn, False, stream, rotary_pos_emb) if i < k \
                        else fn(stream, rotary_pos_emb)
            else:  # uniform: checkpoint every group of k layers
                for i in range(0, n, k):
                    stream = tensor_parallel.checkpoint(self._run(i, min(n, i + k), packed_seq_params), False,
                                                        stream, rotary_pos_emb)
        else:
            stream = self._run(0, n, packed_seq_params)(stream, rotary_pos_emb)
        return stream


def _set(model: torch.nn.Module, kind: type, attribute: str, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, kind):
            setattr(m, attribute, on)


def install_unweighted_swiglu(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.unweighted_swiglu`` on every expert layer of ``model``."""
    _set(model, MuseSparkExperts, "unweighted_swiglu", on)
    return None


def install_te_swiglu_backward(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.te_swiglu_backward`` on every expert layer of ``model``."""
    _set(model, MuseSparkExperts, "te_swiglu_backward", on)
    return None


def install_one_pass_norm_backward(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.one_pass_norm_backward`` on every expert layer of ``model`` (the kernel:
    :mod:`.norm_backward`); why it cannot run here though asked (None: as asked)."""
    _set(model, MuseSparkExperts, "fused_norm_backward", on)
    return "no Triton" if on and not norm_backward.available() else None


def install_fused_pre_mlp_norm(model: torch.nn.Module, on: bool) -> str | None:
    """``engine_options.fused_pre_mlp_norm`` on every decoder layer of ``model``."""
    _set(model, MuseSparkLayer, "fused_pre_mlp_norm", on)
    return None


def _quantization(config, layer: int = -1, *, is_init: bool = False):
    """megatron-core's FP8 context for global layer ``layer`` (none without FP8)."""
    if not config.fp8:
        return nullcontext()
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(config, layer, is_init=is_init)


__all__ = ["MuseSparkAttention", "MuseSparkBlock", "MuseSparkExperts", "MuseSparkLayer", "MuseSparkMoE",
           "MuseSparkRouter", "install_fused_pre_mlp_norm", "install_te_swiglu_backward", "install_unweighted_swiglu",
           "softcap_logits", "set_matmul_dtype"]
