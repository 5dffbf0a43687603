"""The planner's memory for adapters: adapter weights, gradients and optimizer state only (the
frozen base has none), and the routed expert inputs only when the experts carry adapters."""

from __future__ import annotations

from muse_stack.plan.memory import GIB, layer_activation_bytes_per_token
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.models.muse_spark.peft_config import adapter_params_per_layer, resolve


def test_lora_64_counts_adapter_state_and_no_base_gradients():
    recipe = load_recipe("lora-64")
    plan, _ = make_plan(recipe)
    model = recipe.model_config_resolved()
    settings = resolve(recipe.peft, model)
    dense, expert = adapter_params_per_layer(settings, model, tp=4, ep=16, etp=1)
    for stage in plan.memory:
        n = stage.layers
        assert stage.trainable_params == n * (dense + expert)
        # fp32 gradients of the adapters only; Adam's 12 B sharded over DP 4 (dense) and expert DP 1
        assert abs(stage.grads_gib - n * (dense + expert) * 4 / GIB) < 1e-9
        assert abs(stage.optimizer_gib - (n * dense * 12 / 4 + n * expert * 12 / 1) / GIB) < 1e-9
        # bf16 base weights plus bf16 adapters
        assert abs(stage.weights_gib - (stage.params + n * (dense + expert)) * 2 / GIB) < 1e-9
    assert plan.peft["per_expert"] and plan.adapter_params == sum(adapter_params_per_layer(settings, model)) * 62


def test_expert_adapters_keep_the_routed_expert_inputs():
    with_experts, _ = make_plan(load_recipe("lora-64"))
    attention_only, _ = make_plan(load_recipe("lora-64", ["peft.targets=[self_attn.q_proj,self_attn.k_proj,"
                                                          "self_attn.v_proj,self_attn.o_proj]"]))
    recipe = load_recipe("lora-64")
    model = recipe.model_config_resolved()
    act = layer_activation_bytes_per_token(model, 4, True, act_bytes=2)
    k, r = model.num_experts_per_tok, 32
    # per token and layer: the experts' inputs, plus A's rank-r outputs of the four extra targets
    # (two latent projections once per token, two expert GEMMs once per routed slot)
    extra = act["moe_expert_inputs"] + 2 * r * (1 + 1) + 2 * r * (k + k)
    tokens = 4096
    for a, b in zip(with_experts.memory, attention_only.memory):
        want = a.layers * extra * tokens * a.microbatches_in_flight / GIB
        assert abs((a.activations_gib - b.activations_gib) - want) < 1e-9
        assert a.activations_gib > b.activations_gib and a.grads_gib > b.grads_gib


def test_adapter_flops_count_the_frozen_base_without_weight_gradients():
    """2 x 2N + 3 x attention + 6 x N_adapter, N_adapter the adapter parameters a token passes
    through: k of E per-expert adapters, k passes through one shared adapter (exact integers:
    every term is a product of integers below 2^53, so the float sums are exact)."""
    from muse_stack.models.muse_spark.flops import training_flops_per_token
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.models.muse_spark.peft_config import adapter_params_per_layer, resolve

    targets = "peft.targets=[self_attn.q_proj,mlp.experts.gate_up_proj]"
    for per_expert in (True, False):
        recipe = load_recipe("tiny-cpu", ["peft.scheme=lora", targets, f"peft.per_expert={str(per_expert).lower()}",
                                          "peft.rank=4", "peft.alpha=8"])
        cfg = recipe.model_config_resolved()
        settings = resolve(recipe.peft, cfg)
        full = training_flops_per_token(cfg, [64])
        got = training_flops_per_token(cfg, [64], peft=settings)
        dense, expert = adapter_params_per_layer(settings, cfg)
        k, e = cfg.num_experts_per_tok, cfg.num_local_experts
        per_token = cfg.num_hidden_layers * (dense + (expert * k / e if per_expert else expert * k))
        assert got["adapter_params_per_token"] == per_token
        assert got["training"] == 2 * full["matmul_forward"] + 3 * full["attention_forward"] + 6 * per_token
        assert got["training"] < full["training"]


#: lora-64's peft block, as benchmarks/scripts/h200.sh passes it to slice-1gpu (LORA64 there), at the
#: micro-batching the committed adapter runs used (lora-64's own MBS 1, the alltoall dispatcher)
LORA64_ON_SLICE = ["batch.mbs=1", "layout.dispatcher=alltoall", "optimizer.precision_aware=null", "optimizer.param_remainders=null", "peft.scheme=lora", "peft.rank=32", "peft.alpha=32", "peft.dropout=0.0", "peft.per_expert=true",
                   "peft.targets=[self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,"
                   "mlp.experts.gate_up_proj,mlp.experts.down_proj,mlp.pre_expert_proj,mlp.post_expert_proj]",
                   "frozen=[base]"]


def test_lora_64_scaled_to_one_gpu_is_the_measured_slice_run():
    """recipes/overrides/lora-64-1gpu.txt scales lora-64 to one H200; what it trains is what the
    committed adapter benchmark ran (slice-1gpu with lora-64's adapters): same model, layout,
    batch, adapters, optimizer, seeds, data and numerics, so the same memory plan."""
    from pathlib import Path

    scale = (Path(__file__).resolve().parents[2] / "recipes" / "overrides" / "lora-64-1gpu.txt").read_text().split()
    scaled = load_recipe("lora-64", scale)
    slice_run = load_recipe("slice-1gpu", LORA64_ON_SLICE)
    assert scaled.model_config_resolved() == slice_run.model_config_resolved()
    for part in ("layout", "batch", "recompute", "engine_options", "optimizer", "numerics", "hardware"):
        a, b = getattr(scaled, part).model_dump(), getattr(slice_run, part).model_dump()
        # descriptive fields of a layout (label, summary) and the price are not training settings
        for k in ("label", "summary", "highlights", "instance", "price_per_gpu_hour"):
            a.pop(k, None), b.pop(k, None)
        assert a == b, part
    # the same adapters; lora-64 leaves the dropout to the documented table (0.0), the slice run states it
    mine, theirs = (resolve(r.peft, r.model_config_resolved()).as_dict() for r in (scaled, slice_run))
    assert mine.pop("filled") == ["peft.dropout = 0.0"] and theirs.pop("filled") == []
    assert mine == theirs
    assert scaled.frozen == slice_run.frozen == ["base"] and scaled.precision == slice_run.precision
    assert (scaled.training.seed, scaled.training.steps) == (slice_run.training.seed, slice_run.training.steps)
    assert (scaled.data.kind, scaled.data.builder, scaled.data.seed) == ("synthetic", "synthetic", slice_run.data.seed)
    a, _ = make_plan(scaled)
    b, _ = make_plan(slice_run)
    assert a.peak_memory_gib == b.peak_memory_gib and a.fits


def test_step_time_of_a_frozen_base_drops_the_weight_gradients():
    """With adapters the base GEMMs' backward is data gradients only: per micro-batch, the base
    GEMM terms are 2x their forward instead of 3x, plus the adapters' GEMMs 3x theirs."""
    from muse_stack.machine.hardware import gpu_spec
    from muse_stack.plan.cost import TimeCalibration, adapter_terms

    full_recipe = load_recipe("slice-1gpu", LORA64_ON_SLICE[:2])  # the same micro-batching
    peft_recipe = load_recipe("slice-1gpu", LORA64_ON_SLICE)
    full, _ = make_plan(full_recipe)
    peft, _ = make_plan(peft_recipe)
    model = peft_recipe.model_config_resolved()
    spec = gpu_spec("H200")
    adapters = adapter_terms(resolve(peft_recipe.peft, model), model, spec, TimeCalibration(),
                             tokens=peft_recipe.batch.seq_length, tp=1, ep=1, etp=1)
    layers, micro = model.num_hidden_layers, peft.time.microbatches
    assert adapters["dense_gemm"] > 0 and adapters["expert_gemm"] > 0
    # the identity is exact up to float rounding
    # (a handful of additions of numbers of one magnitude: relative 1e-12 is far above 1e-16 x terms)
    want = full.time.terms_s["expert_gemm"] * 2 / 3 + 3 * adapters["expert_gemm"] * layers * micro
    assert abs(peft.time.terms_s["expert_gemm"] - want) <= 1e-12 * want
    # dense GEMMs likewise, the (frozen) output layer included
    want = full.time.terms_s["dense_gemm"] * 2 / 3 + 3 * adapters["dense_gemm"] * layers * micro
    assert abs(peft.time.terms_s["dense_gemm"] - want) <= 1e-12 * want
    assert peft.time.step_s < full.time.step_s
    # the MFU counts the adapter FLOPs: 2 x 2N + 3A + 6 N_adapter per token
    assert peft.time.mfu < full.time.mfu
