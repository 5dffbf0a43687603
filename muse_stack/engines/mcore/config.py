"""The megatron-core ``TransformerConfig`` of a Muse Spark recipe.

:func:`transformer_config_kwargs` is pure (no megatron-core import) so the translation is
tested anywhere; :func:`transformer_config` builds the real object.

What megatron-core expresses as config is taken from it: GQA shapes, the softmax scale
(``qk_scale_factor / sqrt(head_dim)``), the sliding window (megatron's ``(W - 1, 0)`` is W keys
counting the query) with ``window_attn_skip_freq`` (1 = sliding) and ``no_rope_freq``
(1 = NoPE) per layer, the latent MoE width (``moe_latent_size``), sigmoid routing with an
expert (selection) bias, top-k, grouped GEMM, the alltoall dispatcher, and every
parallelism. The rest (gated residuals, post-norms, parameter-free norms, the attention
output gate with its norm, the router's logit multiplier, the softcap) lives in the layer
spec of :mod:`muse_stack.engines.mcore.layers`.
"""

from __future__ import annotations

from typing import Any

from muse_stack.util.errors import RecipeError
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.recipes import options
from muse_stack.recipes.schema import Recipe


#: selective recompute: the attention core (ours), the experts' SwiGLU (megatron-core's
#: TEGroupedMLP) and the whole MoE layer (megatron-core's MoELayer); none is the default
#: ``core_attn`` when ``recompute.modules`` is not given
SELECTIVE_RECOMPUTE_MODULES = ("core_attn", "moe_act", "moe")


def pipeline_split(recipe: Recipe, num_layers: int) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts for megatron-core's uneven pipeline split."""
    lay = recipe.layout
    if lay.pp <= 1:
        return None, None
    if lay.pp_layers:
        if len(lay.pp_layers) != lay.pp or sum(lay.pp_layers) != num_layers:
            raise RecipeError("pp_layers must list one count per stage that add up to the layers",
                              field="layout.pp_layers", value=lay.pp_layers,
                              fix=f"{lay.pp} counts summing to {num_layers}")
        middle = lay.pp_layers[1:-1]
        if middle and len(set(middle)) != 1:
            raise RecipeError("megatron-core splits the middle stages evenly", field="layout.pp_layers",
                              value=lay.pp_layers, fix="use equal counts for every stage but the first and last")
        return lay.pp_layers[0], lay.pp_layers[-1]
    return lay.first_stage_layers, lay.last_stage_layers


def virtual_stages(recipe: Recipe) -> int | None:
    """megatron-core's virtual pipeline size: None for one model chunk per stage (``vpp`` unset
    or 1, plain 1F1B). Interleaved stages are refused: the engine builds one chunk per stage."""
    vpp = recipe.layout.vpp
    if vpp is None or vpp == 1:
        return None
    raise RecipeError("the megatron engine builds one model chunk per pipeline stage; interleaved (virtual) "
                      "pipeline stages are not supported", field="layout.vpp", value=vpp,
                      rule="layout.vpp unset or 1", fix="set layout.vpp=1 (plain 1F1B over the same stages)")


def fp8_kwargs(recipe: Recipe) -> dict[str, Any]:
    """megatron-core's FP8 settings for ``precision: fp8`` (none otherwise): the stated format and
    scaling recipe; the first and last layers stay bf16 as everything outside the decoder does."""
    if recipe.precision != "fp8":
        return {}
    settings = recipe.fp8
    # the grouped expert GEMMs take FP8 inputs in multiples of 16 (32 for MXFP8) tokens per expert. The
    # alltoall and flex dispatchers pad the routing map with empty slots (megatron-core's router padding,
    # which computes nothing); megatron-core refuses that padding with the allgather dispatcher, where
    # TEGroupedMLP pads each expert's rows itself (TE's Fp8Padding) and unpads its output
    router_pads = (recipe.layout.dispatcher or "alltoall") != "allgather"
    return {"fp8": settings.format, "fp8_recipe": settings.recipe, "moe_router_padding_for_quantization": router_pads}


def group_schedule(group: dict[str, Any], lr: float, weight_decay: float) -> tuple[float, float]:
    """A megatron-core parameter group's learning rate and weight decay at a step whose schedule gives ``lr``: its
    ``lr_mult`` and ``wd_mult`` applied, as megatron-core's ``OptimizerParamScheduler.step`` applies them. The
    engine sets the rate itself (:meth:`MegatronEngine.set_lr`, not the scheduler), and megatron-core's groups
    carry no ``weight_decay`` of their own: without this every group, the norms' gains and the biases included,
    would take the optimizer's default decay, where ``get_standard_config_overrides`` gives them ``wd_mult`` 0
    (as the reference engine exempts every parameter of one dimension)."""
    return lr * group.get("lr_mult", 1.0), weight_decay * group.get("wd_mult", 1.0)


def ddp_config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """megatron-core ``DistributedDataParallelConfig`` fields (pure): fp32 gradient reduction, the
    recipe's distributed optimizer, and the engine options that are DDP fields (muse_stack/recipes/options.py)."""
    dist_opt = recipe.layout.distributed_optimizer if recipe.layout.distributed_optimizer is not None else True
    return dict(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt, check_for_nan_in_grad=False,
                **options.config_fields(options.resolve(recipe), "ddp"))


def transformer_config_kwargs(recipe: Recipe, model: ModelConfig) -> dict[str, Any]:
    """Keyword arguments of megatron-core's TransformerConfig (dtypes as strings); the engine options that
    are its fields as the recipe resolves them (muse_stack/recipes/options.py), after refusing any it cannot
    run."""
    options.check(recipe)
    lay = recipe.layout
    tp, pp, cp, ep = lay.tp, lay.pp, lay.cp or 1, lay.ep or 1
    if model.num_attention_heads % tp or model.num_key_value_heads % tp:
        raise RecipeError("attention heads do not split over tensor parallelism", field="layout.tp", value=tp,
                          fix=f"a TP that divides {model.num_key_value_heads} KV heads")
    if model.num_local_experts % ep:
        raise RecipeError("experts do not split over expert parallelism", field="layout.ep", value=ep,
                          fix=f"an EP that divides {model.num_local_experts}")
    sliding = [0 if model.is_full_attention(i) else 1 for i in range(model.num_hidden_layers)]
    nope = [0 if model.uses_rope(i) else 1 for i in range(model.num_hidden_layers)]
    sp = bool(lay.sequence_parallel) if lay.sequence_parallel is not None else tp > 1
    first, last = pipeline_split(recipe, model.num_hidden_layers)
    rc = recipe.recompute
    granularity = rc.granularity if rc.granularity not in (None, "none") else None
    if granularity == "selective" and rc.modules:
        unknown = [m for m in rc.modules if m not in SELECTIVE_RECOMPUTE_MODULES]
        if unknown:
            raise RecipeError("the engine cannot recompute these modules selectively", field="recompute.modules",
                              value=rc.modules, rule=f"one of {', '.join(SELECTIVE_RECOMPUTE_MODULES)}",
                              fix=f"drop {', '.join(unknown)}, or use recompute.granularity: full")
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        gated_linear_unit=True,
        activation_func="silu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        softmax_scale=model.softmax_scale,
        window_size=(model.sliding_window - 1, 0),
        window_attn_skip_freq=sliding,
        no_rope_freq=nope,
        num_moe_experts=model.num_local_experts,
        moe_ffn_hidden_size=model.moe_intermediate_size,
        moe_latent_size=model.moe_hidden_size,
        moe_router_topk=model.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_topk_scaling_factor=None if model.routed_scaling_factor == 1.0 else model.routed_scaling_factor,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type=lay.dispatcher or "alltoall",
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_stages(recipe),
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        context_parallel_size=cp,
        cp_comm_type=lay.cp_comm_type or "a2a",
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=lay.etp,
        recompute_granularity=granularity,
        recompute_method=(rc.method or "uniform") if granularity == "full" else None,
        recompute_num_layers=(rc.num_layers or 1) if granularity == "full" else None,
        recompute_modules=rc.modules if granularity == "selective" and rc.modules else None,
        calculate_per_token_loss=True,
        init_method_std=model.initializer_range,
        # fp8: bf16 weights and everything between the GEMMs, TE's FP8 GEMMs in the decoder layers
        bf16=recipe.precision in ("bf16", "fp8"),
        fp16=False,
        params_dtype="bfloat16" if recipe.precision in ("bf16", "fp8") else "float32",
        **fp8_kwargs(recipe),
        pipeline_dtype="float32",  # the residual stream crosses stages in fp32
        bias_activation_fusion=True,
        apply_rope_fusion=True,
        variable_seq_lengths=False,
        deterministic_mode=bool(recipe.numerics.deterministic),
        # engine options (moe_permute_fusion, moe_router_fusion, gradient_accumulation_fusion, ...)
        **options.config_fields(options.resolve(recipe), "transformer"),
    )
    if kwargs["recompute_modules"] is None:
        kwargs.pop("recompute_modules")
    return kwargs


def transformer_config(recipe: Recipe, model: ModelConfig, **extra: Any):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = {**transformer_config_kwargs(recipe, model), **extra}
    kwargs["activation_func"] = F.silu
    kwargs["params_dtype"] = getattr(torch, kwargs["params_dtype"])
    kwargs["pipeline_dtype"] = getattr(torch, kwargs["pipeline_dtype"])
    std = kwargs["init_method_std"]
    from megatron.core.utils import init_method_normal

    kwargs["init_method"] = init_method_normal(std)
    kwargs["output_layer_init_method"] = init_method_normal(std)
    return TransformerConfig(**kwargs)


def optimizer_config_kwargs(recipe: Recipe) -> dict[str, Any]:
    """megatron-core ``OptimizerConfig`` fields from the recipe's optimizer (pure; every training
    value comes from the recipe, which :func:`muse_stack.engines.support.require_stated` checks;
    ``params_dtype`` is added by the engine from its ``TransformerConfig``)."""
    options.check(recipe)
    opt = recipe.optimizer
    dist_opt = ddp_config_kwargs(recipe)["use_distributed_optimizer"]
    kwargs: dict[str, Any] = dict(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr if opt.min_lr is not None else opt.lr,
        weight_decay=opt.weight_decay, adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_eps=opt.eps,
        clip_grad=opt.clip_grad, bf16=recipe.precision in ("bf16", "fp8"), use_distributed_optimizer=dist_opt,
        # TE's FusedAdam updates the master weights and writes the bf16 weights in one kernel (no
        # separate fp32 -> bf16 copy pass); with remainders the master is the bf16 weight + int16
        use_precision_aware_optimizer=bool(opt.precision_aware),
        store_param_remainders=bool(opt.precision_aware and opt.param_remainders),
        # engine options (optimizer_cuda_graph: TE's capturable FusedAdam, lr and step on the GPU, for
        # megatron-core's OptimizerCudaGraphWrapper)
        **options.config_fields(options.resolve(recipe), "optimizer"))
    return kwargs
