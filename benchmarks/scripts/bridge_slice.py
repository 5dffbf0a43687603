"""Throughput of Megatron-Bridge's own ``pretrain`` loop at a recipe's shapes, beside
``benchmarks/scripts/engine_steps.py`` (the same JSON, the same measurement).

The model is the closest one Bridge's ``GPTModelProvider`` expresses: every field that
:func:`muse_stack.engines.mcore.config.transformer_config_kwargs` maps from the recipe and the
provider accepts (GQA, softmax scale, sliding window pattern, per-layer NoPE, latent MoE, sigmoid
router with expert bias, grouped GEMM, the recipe's dispatcher, ...), plus the attention output gate
and a (weighted) QK norm. What Bridge cannot express is listed in ``NOT_EXPRESSED`` and in the
JSON. Data: Bridge's mock GPT dataset and the null tokenizer at the recipe's
vocabulary. No checkpoints, evaluation, tensorboard or wandb.

Timing: Bridge's ``train_step`` is wrapped where its loop looks it up
(``megatron.bridge.training.train.train_step``), each call bracketed by
``torch.cuda.synchronize()`` as engine_steps.py brackets the engine's step.

MFU is given twice: with our formula for the Muse slice (what our engine's MFU uses) and with
the same formula for the model Bridge ran (the difference is listed); Bridge's own
``flop_utils.num_floating_point_operations`` figure is recorded beside them.

    bash benchmarks/scripts/bridge/stage.sh install DIR   # Bridge + its import-time needs into /tmp/site-bridge
    PYTHONPATH=/tmp/site-bridge:/tmp/site:. python3 benchmarks/scripts/bridge_slice.py slice-1gpu --steps 30 --warmup 10 --out x.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.benchio import finish, recipe_args  # noqa: E402

#: Muse Spark features the Bridge model lacks (no config field in Bridge 0.6.2 / megatron-core 0.19.2);
#: all are elementwise or norm work, which the FLOP formula does not count
NOT_EXPRESSED = (
    "gated residuals (residual_gate_temperature) on an fp32 residual stream (--fp32-residual gives the stream only)",
    "post-attention and post-feedforward norms",
    "pre-expert norm on the latent and post-expert norm per expert slot before the routing weight",
    "router logit multiplier (output_multiplier) and renormalisation eps (router_bias_eps)",
    "output logit multiplier and final logit softcap",
    "RMS norm of the attention output before the sigmoid gate (Bridge gates the raw output)",
    "weightless QK norm (Bridge's qk_layernorm has a head_dim gain; zero-centred, so 1 at init)",
    "weightless norms / stored gains: Bridge's RMSNorm gains are zero-centred parameters",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = recipe_args(steps=30, warmup=10)
    ap.add_argument("--dry-run", action="store_true", help="build and print the ConfigContainer, train nothing")
    ap.add_argument("--no-output-gate", action="store_true", help="drop attention_output_gate")
    ap.add_argument("--no-qk-norm", action="store_true", help="drop qk_layernorm")
    ap.add_argument("--no-router-fusion", action="store_true", help="unfused top-k (moe_router_fusion off)")
    ap.add_argument("--cross-entropy", choices=("te", "native", "off"), default="te",
                    help="cross_entropy_loss_fusion with this impl, or unfused")
    ap.add_argument("--grad-accum-fusion", choices=("te", "auto", "on", "off"), default="te",
                    help="te (default): on, and where APEX's fused_weight_gradient_mlp_cuda is absent megatron-core's "
                         "output layer accumulates its weight gradient with Transformer Engine's fp32-accumulating "
                         "GEMM (te_wgrad_accumulation); auto: on only where APEX is importable (else off everywhere)")
    ap.add_argument("--grad-reduce", choices=("fp32", "bf16"), default="fp32", help="gradient reduce dtype (ours: fp32)")
    ap.add_argument("--fp32-residual", action="store_true", help="fp32_residual_connection (our residual stream is fp32)")
    ap.add_argument("--attention-backend", choices=("auto", "fused", "flash"), default="auto")
    ap.add_argument("--no-manual-gc", action="store_true", help="Python GC as usual (Bridge's perf recipes collect manually)")
    ap.add_argument("--log-interval", type=int, default=10)
    return ap.parse_args(argv)


def _dist_env() -> None:
    """One process: the variables torch.distributed's env:// init reads, where a launcher set none
    (NVLink multicast off, as benchmarks/scripts/h200.sh has it)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500"), ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
                       ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)


def _import_bridge():
    import importlib

    try:
        for name in ("megatron.bridge", "megatron.bridge.models.gpt_provider", "megatron.bridge.training.pretrain"):
            importlib.import_module(name)
    except ImportError as e:
        raise SystemExit(f"bridge_slice: Megatron-Bridge is not importable ({e}); install it with "
                         "benchmarks/scripts/bridge/stage.sh install and put its target (/tmp/site-bridge) on PYTHONPATH") from e


def fields_of(config_cls, mapped: dict) -> tuple[dict, list[str]]:
    """The entries of ``mapped`` that are fields of the dataclass ``config_cls``, and the names of those that are not."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {k: v for k, v in mapped.items() if k in names}, sorted(set(mapped) - names)


def provider_kwargs(recipe, cfg, args, provider_cls) -> tuple[dict, list[str]]:
    """GPTModelProvider keyword arguments: our TransformerConfig mapping where the provider has the
    field, then Bridge's GPT fields and fusions; also the mapped keys the provider lacks."""
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import layers as tp_layers

    from muse_stack.engines.mcore.config import transformer_config_kwargs

    mapped = transformer_config_kwargs(recipe, cfg)
    mapped["activation_func"] = F.silu
    mapped["params_dtype"] = getattr(torch, mapped["params_dtype"])
    mapped["pipeline_dtype"] = getattr(torch, mapped["pipeline_dtype"])
    kwargs, dropped = fields_of(provider_cls, mapped)
    accum = {"on": True, "off": False, "te": True}.get(args.grad_accum_fusion, tp_layers._grad_accum_fusion_available)
    kwargs.update(
        vocab_size=cfg.vocab_size, should_pad_vocab=False, seq_length=recipe.batch.seq_length,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=cfg.rope_theta, rotary_percent=1.0,
        attention_output_gate=not args.no_output_gate, qk_layernorm=not args.no_qk_norm,
        fp32_residual_connection=args.fp32_residual,
        transformer_impl="transformer_engine", attention_backend=args.attention_backend,
        bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=True, persist_layer_norm=True,
        apply_rope_fusion=True, gradient_accumulation_fusion=accum,
        # the fusions the recipe resolves (engine_options: the runner's own), --no-router-fusion forcing the router's off
        moe_permute_fusion=mapped.get("moe_permute_fusion", True),
        moe_router_fusion=bool(mapped.get("moe_router_fusion", True)) and not args.no_router_fusion,
        cross_entropy_loss_fusion=args.cross_entropy != "off",
        cross_entropy_fusion_impl=args.cross_entropy if args.cross_entropy != "off" else "native",
        use_transformer_engine_op_fuser=False, cuda_graph_impl="none",
    )
    return kwargs, dropped


def engine_optimizer_kwargs(recipe, config_cls) -> tuple[dict, list[str]]:
    """Bridge's OptimizerConfig from the engine's own mapping of the recipe
    (:func:`muse_stack.engines.mcore.config.optimizer_config_kwargs`: the precision-aware optimizer, its
    remainders and every optimizer engine option included), less the fields Bridge's class lacks."""
    from muse_stack.engines.mcore.config import optimizer_config_kwargs

    return fields_of(config_cls, optimizer_config_kwargs(recipe))


def engine_ddp_kwargs(recipe, config_cls, fp32_reduce: bool) -> tuple[dict, list[str]]:
    """Bridge's DistributedDataParallelConfig from the engine's own mapping
    (:func:`muse_stack.engines.mcore.config.ddp_config_kwargs`), with the reduce dtype of --grad-reduce and
    no overlap (one GPU: nothing to overlap), less the fields Bridge's class lacks."""
    from muse_stack.engines.mcore.config import ddp_config_kwargs

    mapped = dict(ddp_config_kwargs(recipe), grad_reduce_in_fp32=fp32_reduce, overlap_grad_reduce=False,
                  overlap_param_gather=False, average_in_collective=False, check_for_large_grads=False)
    return fields_of(config_cls, mapped)


def te_wgrad_accumulation():
    """``fused_weight_gradient_mlp_cuda`` for megatron-core's ``ColumnParallelLinear`` (Bridge's GPT output
    layer) where APEX is absent: its weight gradient accumulated into ``main_grad`` by Transformer Engine's
    ``general_gemm`` (cuBLAS, fp32 accumulation and output, ``accumulate=True``), the call TE's own Linear
    makes for its fused weight-gradient accumulation. NVIDIA's container has APEX's kernel; this is the
    closest equivalent the staged stack has, so Bridge runs with gradient_accumulation_fusion on as there."""
    import types

    import torch
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        x = total_input.reshape(-1, total_input.shape[-1])
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        general_gemm(x, dy, out_dtype=main_grad.dtype, accumulate=True, layout="NT", out=main_grad, grad=True)

    return types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate, wgrad_gemm_accum_fp16=accumulate)


def install_te_wgrad_accumulation() -> str:
    """Give megatron-core's tensor-parallel layers TE's accumulation where APEX is missing; say which ran."""
    from megatron.core.tensor_parallel import layers as tp_layers

    if tp_layers._grad_accum_fusion_available:
        return "APEX fused_weight_gradient_mlp_cuda"
    tp_layers.fused_weight_gradient_mlp_cuda = te_wgrad_accumulation()
    tp_layers._grad_accum_fusion_available = True
    return "Transformer Engine general_gemm (fp32, accumulate) in place of APEX's fused_weight_gradient_mlp_cuda"


def build_config(recipe, cfg, args):
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RerunStateMachineConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.mixed_precision import bf16_mixed

    if recipe.precision != "bf16":
        raise SystemExit(f"bridge_slice: only bf16 recipes are set up here (got {recipe.precision})")
    kwargs, dropped = provider_kwargs(recipe, cfg, args, GPTModelProvider)
    model = GPTModelProvider(**kwargs)
    b, o = recipe.batch, recipe.optimizer
    fp32_reduce = args.grad_reduce == "fp32"
    opt_kwargs, opt_dropped = engine_optimizer_kwargs(recipe, OptimizerConfig)
    ddp_kwargs, ddp_dropped = engine_ddp_kwargs(recipe, DistributedDataParallelConfig, fp32_reduce)
    dropped += [f"optimizer.{k}" for k in opt_dropped] + [f"ddp.{k}" for k in ddp_dropped]
    precision = bf16_mixed()
    precision.grad_reduce_in_fp32 = fp32_reduce
    config = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=args.steps, global_batch_size=b.gbs, micro_batch_size=b.mbs,
                             manual_gc=not args.no_manual_gc, manual_gc_interval=100, manual_gc_eval=False),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=OptimizerConfig(**opt_kwargs),
        scheduler=SchedulerConfig(lr_decay_style=o.decay_style or "cosine", lr_warmup_iters=o.warmup_steps or 0,
                                  lr_warmup_init=0.0, lr_decay_iters=args.steps, start_weight_decay=o.weight_decay,
                                  end_weight_decay=o.weight_decay, weight_decay_incr_style="constant",
                                  override_opt_param_scheduler=True),
        ddp=DistributedDataParallelConfig(**ddp_kwargs),
        dataset=MockGPTDatasetConfig(seq_length=b.seq_length, random_seed=recipe.data.seed or recipe.training.seed,
                                     reset_attention_mask=False, reset_position_ids=False, eod_mask_loss=False,
                                     num_dataset_builder_threads=1, split="9999,8,2", data_sharding=True,
                                     dataloader_type="single", skip_getting_attention_mask_from_dataset=True,
                                     num_workers=2),
        logger=LoggerConfig(log_interval=args.log_interval, tensorboard_dir=None, wandb_project=None),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=cfg.vocab_size,
                                  use_tokenizer_vocab_size=False),
        checkpoint=CheckpointConfig(save=None, load=None, save_interval=None),
        rng=RNGConfig(seed=recipe.training.seed),
        rerun_state_machine=RerunStateMachineConfig(check_for_nan_in_loss=False),
        mixed_precision=precision,
    )
    return config, dropped


def bridge_model_flops(cfg, seq_lens, output_gate: bool) -> dict[str, float]:
    """Our formula for the model Bridge ran: the Muse slice's matmuls and attention, less the
    output-gate projection when it is off (what Bridge leaves out is elementwise work)."""
    from muse_stack.models.muse_spark.flops import training_flops_per_token

    flops = dict(training_flops_per_token(cfg, seq_lens))
    if not output_gate:
        gate = 2.0 * cfg.num_hidden_layers * cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim
        flops["matmul_forward"] -= gate
        flops["training"] -= 3 * gate
        flops["training_6n"] -= 3 * gate
    return flops


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _dist_env()
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"bridge_slice: torch is not importable ({e})") from e
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bridge_slice: no CUDA device; Bridge's pretrain loop needs one (--dry-run builds the config only)")
    _import_bridge()

    from muse_stack.models.muse_spark.flops import FORMULA, training_flops_per_token
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.machine.devmem import cuda_memory
    from muse_stack.machine.peak import peak_for

    recipe = load_recipe(args.recipe, [*args.overrides, f"training.steps={args.steps}"])
    cfg = recipe.model_config_resolved()
    wgrad = install_te_wgrad_accumulation() if args.grad_accum_fusion == "te" else None
    config, dropped = build_config(recipe, cfg, args)
    if args.dry_run:
        config.print_yaml()
        print(f"# recipe fields the provider has no field for: {dropped}")
        return 0

    import megatron.bridge.training.train as bridge_train
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    tokens = recipe.batch.gbs * recipe.batch.seq_length
    rows: list[dict] = []
    params: dict[str, int] = {}
    inner = bridge_train.train_step

    def timed_train_step(*a, **k):
        if not params:
            model = a[2] if len(a) > 2 else k["model"]
            params["local"] = sum(p.numel() for m in model for p in m.parameters())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(*a, **k)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        loss = next((float(v) for key, v in out[0].items() if "loss" in key), None) if out[0] else None
        grad_norm = out[5]
        rows.append({"step": len(rows) + 1, "loss": loss, "grad_norm": None if grad_norm is None else float(grad_norm),
                     "skipped": bool(out[1]), "tokens": tokens, "step_time_s": dt})
        return out

    bridge_train.train_step = timed_train_step
    _use_prebuilt_dataset_helpers()
    try:
        pretrain(config, forward_step)
    finally:
        bridge_train.train_step = inner
    if len(rows) <= args.warmup:
        raise SystemExit(f"bridge_slice: Bridge ran {len(rows)} steps, not more than --warmup {args.warmup}")

    window = rows[args.warmup:]
    tps = sum(r["tokens"] for r in window) / sum(r["step_time_s"] for r in window)
    seq_lens = [recipe.batch.seq_length]
    muse = training_flops_per_token(cfg, seq_lens)
    ran = bridge_model_flops(cfg, seq_lens, output_gate=not args.no_output_gate)
    try:
        from megatron.bridge.training.utils.flop_utils import (
            num_floating_point_operations,
        )

        bridge_own = float(num_floating_point_operations(config, batch_size=recipe.batch.gbs)) / tokens
        bridge_own_note = "megatron.bridge.training.utils.flop_utils.num_floating_point_operations(cfg, gbs) / tokens"
    except Exception as e:  # noqa: BLE001 -- a record, not a failure: the run itself is done
        bridge_own, bridge_own_note = None, f"not computed: {type(e).__name__}: {e}"
    peak, source = peak_for(recipe.hardware.gpu)

    def mfu(per_token):
        return per_token * tps / 1e12 / peak if peak and per_token else None

    result = {
        "recipe": args.recipe, "overrides": args.overrides, "device": torch.cuda.get_device_name(),
        "engine": "megatron-bridge pretrain", "versions": _versions(),
        "method": f"{args.steps} steps, window steps {args.warmup + 1}-{args.steps}; each Bridge train_step "
                  "bracketed by torch.cuda.synchronize()",
        "tokens_per_s_per_gpu": tps, "step_time_mean_s": statistics.fmean(r["step_time_s"] for r in window),
        "flops_per_token": muse["training"], "flops_formula": FORMULA,
        "mfu": mfu(muse["training"]), "model_tflops_per_gpu": muse["training"] * tps / 1e12,
        "bridge_model_flops_per_token": ran["training"], "mfu_bridge_model": mfu(ran["training"]),
        "flops_difference_per_token": muse["training"] - ran["training"],
        "flops_difference_source": "the attention output-gate projection (--no-output-gate)" if args.no_output_gate
        else "none by the formula: what Bridge cannot express is elementwise/norm work the formula does not count",
        "bridge_own_flops_per_token": bridge_own, "bridge_own_flops_source": bridge_own_note,
        "mfu_bridge_own_flops": mfu(bridge_own),
        "peak_tflops": peak, "peak_source": source,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device_memory": cuda_memory(f"cuda:{torch.cuda.current_device()}"),
        "local_parameters": params.get("local"), "not_expressed": list(NOT_EXPRESSED),
        "recipe_fields_without_provider_field": dropped, "settings": _settings(config, args),
        "output_layer_wgrad_accumulation": wgrad,
        "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"], "steps": rows,
    }
    finish(result, args.out, omit=lambda k: k in ("steps", "settings", "not_expressed"))
    return 0


def _use_prebuilt_dataset_helpers() -> None:
    """Bridge's initialisation runs megatron-core's ``compile_helpers`` (``make`` in the installed
    package), which fails where the wheel ships the built ``helpers_cpp`` extension and no
    Makefile: use the built extension when it imports, compile only when it does not."""
    import megatron.bridge.training.initialize as init

    original = init.compile_helpers

    def compile_helpers() -> None:
        try:
            import megatron.core.datasets.helpers_cpp  # noqa: F401 - the wheel's prebuilt extension
        except ImportError:
            original()

    init.compile_helpers = compile_helpers


def _settings(config, args) -> dict:
    m = config.model
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "softmax_scale",
            "window_size", "window_attn_skip_freq", "no_rope_freq", "num_moe_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "moe_latent_size", "moe_router_score_function", "moe_router_enable_expert_bias",
            "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_permute_fusion", "moe_router_fusion",
            "attention_output_gate", "qk_layernorm", "layernorm_zero_centered_gamma", "fp32_residual_connection",
            "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
            "apply_rope_fusion", "bias_activation_fusion", "masked_softmax_fusion", "attention_backend",
            "vocab_size", "seq_length", "calculate_per_token_loss")
    out = {k: str(getattr(m, k, None)) if k == "attention_backend" else getattr(m, k, None) for k in keys}
    out.update(ddp_grad_reduce_in_fp32=config.ddp.grad_reduce_in_fp32,
               use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
               use_precision_aware_optimizer=config.optimizer.use_precision_aware_optimizer,
               store_param_remainders=config.optimizer.store_param_remainders,
               gbs=config.train.global_batch_size, mbs=config.train.micro_batch_size,
               manual_gc=config.train.manual_gc, cli={k: v for k, v in vars(args).items() if k != "overrides"})
    return out


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("megatron-bridge", "megatron-core", "transformer-engine", "torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
