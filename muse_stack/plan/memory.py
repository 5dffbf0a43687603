"""Per-GPU memory estimate for one pipeline stage of a megatron-core run.

Bytes per parameter follow megatron-core's mixed-precision training: bf16 weights (2 B),
fp32 gradient buffers (4 B), and Adam's fp32 master weights plus two moments (12 B; 10 B when
``optimizer.param_remainders`` keeps each master as the bf16 weight plus an int16 remainder), the
last sharded over the data-parallel group with the distributed optimizer. Expert parameters
shard over the expert-data-parallel group, world / (EP x ETP x PP), dense parameters over
DP x CP. Activations follow the layer's formulas (see :func:`layer_activation_bytes_per_token`)
under the recompute setting, times the micro-batches a 1F1B pipeline stage keeps in flight.

An image-text recipe's first stage also holds the perception towers and the projector
(:mod:`muse_stack.plan.towers`: whole on every GPU of the stage, their trainable parts with fp32
gradients and DP-sharded optimizer state like dense weights, a frozen part with its weights only),
and the activations their trainable parts keep for each micro-batch in flight.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from muse_stack.engines.support import optimizer_state_bytes
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.plan.calibration import calibrated
from muse_stack.recipes import options as engine_options
from muse_stack.models.muse_spark.peft_config import adapter_params_per_layer
from muse_stack.recipes.schema import Recipe

GIB = 2**30


class Calibration(BaseModel):
    """Terms the formulas do not derive: how much the activations really keep, and runtime buffers.

    The measured defaults are the values fitted on an H200 with megatron-core + TE (benchmarks/), read
    from muse_stack/plan/calibration.json (``memory``, with the folder and command of each); they are
    stated in every plan.
    """

    model_config = ConfigDict(frozen=True)

    # Fitted by benchmarks/scripts/plan/fit.py to the peak allocated memory (torch.cuda.max_memory_allocated)
    # of every eager megatron-core run in benchmarks/ (14 runs: TP, PP, CP, EP, ETP, packed rows,
    # full and selective recompute): peak = static + logits + activation_factor x activations +
    # runtime_overhead_gib, least squares. Static memory (bf16 weights, fp32 gradient buffers, Adam
    # state) is allocated exactly and is not scaled. The CUDA context and NCCL's own buffers sit
    # outside the caching allocator and are not in these peaks. activation_factor: measured activation
    # bytes per modelled byte (fp32 temporaries of the norms and gates).
    activation_factor: float = calibrated("memory", "activation_factor")
    # The same, fitted (with runtime_overhead_gib fixed) to the runs whose elementwise chains were
    # fused by torch.compile (recipe engine_options.compile_elementwise): fused chains keep fewer temporaries.
    compiled_activation_factor: float = calibrated("memory", "compiled_activation_factor")
    # cuBLAS/TE workspaces and other allocations outside the formulas
    runtime_overhead_gib: float = calibrated("memory", "runtime_overhead_gib")
    logits_bytes: int = 10  # per logit on the last stage: fp32 logits, their gradient, bf16 copy
    # Policy, not a measurement: the estimate is of allocated memory (what the calibration above was
    # fitted to); a plan fits only if this share of the GPU stays free for what that leaves out:
    # the CUDA context, NCCL's communicator buffers and the caching allocator's fragmentation.
    headroom_fraction: float = 0.10
    source: str = "H200 megatron-core measurements, benchmarks/results/plan/README.md"

    def activation_factor_for(self, compiled: bool) -> float:
        return self.compiled_activation_factor if compiled else self.activation_factor


class StageMemory(BaseModel):
    stage: int
    layers: int
    holds: list[str]
    params: int
    trainable_params: int
    dense_params: int
    expert_params: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float | None  # as modelled; total_gib counts activation_factor x this
    logits_gib: float | None
    buffers_gib: float
    activation_factor: float = 1.0
    total_gib: float | None
    microbatches_in_flight: int | None


def layer_activation_bytes_per_token(m: ModelConfig, tp: int, sp: bool, act_bytes: int = 2,
                                     etp: int = 1) -> dict[str, float]:
    """Bytes one token leaves stored in one decoder layer for the backward pass (no recompute).

    Tensors outside the TP-split regions are divided by TP only with sequence parallelism.
    Under expert tensor parallelism the dispatcher gathers the tokens of all ETP ranks, so each
    rank holds ETP x the routed slots at the latent width and 1 / ETP of the expert FFN width.
    Also returned: what each selective-recompute module frees per token and layer.
    """
    h, hm, i, k, e = m.hidden_size, m.moe_hidden_size, m.moe_intermediate_size, m.num_experts_per_tok, m.num_local_experts
    hq, hkv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    seq_div = tp if sp else 1
    b = act_bytes
    # outside TP regions: input norm, residual gate math (fp32 stream), post-attn norm
    attn_outside = (b * h + 4 * h + b * h + b * h) / seq_div
    # inside: q,k,v projections, normed/rotated q,k, output gate, attention output, gated output
    attn_inside = b * ((hq + 2 * hkv) + (hq + hkv) + hq + hq + 2 * hq) / tp
    moe_input = b * h / seq_div
    moe_outside = moe_input + (4 * e * 2 + 4 * h + b * h * 3) / seq_div
    moe_latent = b * (2 * hm + hm) / seq_div
    # each routed slot (a GPU receives k slots per local token on average, x ETP when ETP
    # gathers): dispatched input, down out, post-expert norm at the latent width; gate_up out,
    # activation, product at the (ETP-split) FFN width
    moe_act = k * b * i / seq_div  # the SwiGLU output, per local token
    moe_slots = k * b * (3 * hm * etp + 4 * i) / seq_div
    moe = moe_outside + moe_latent + moe_slots
    return {
        "attention": attn_outside + attn_inside,
        "attention_inside": attn_inside,
        "moe": moe,
        # selective recompute: what each module no longer keeps (TE's fused attention core keeps
        # only q, k, v, its output and the softmax statistics, which its neighbours hold anyway)
        "recompute_core_attn": 0.0,
        # the routed slots' inputs of the two expert GEMMs (dispatched latent, SwiGLU product):
        # kept only for weight gradients, so a frozen base without expert adapters drops them
        "moe_expert_inputs": k * b * (hm * etp + i) / seq_div,
        "recompute_moe_act": moe_act,
        "recompute_moe": moe - moe_input,
    }


def selective_bytes_per_token(act: dict[str, float], modules: list[str] | None) -> tuple[float, float]:
    """(freed per token and layer, recomputed working set per token of one layer) for the
    selective recompute ``modules`` (megatron-core's default: core_attn)."""
    freed = working = 0.0
    for name in modules or ["core_attn"]:
        saved = act.get(f"recompute_{name}")
        if saved is None:
            continue  # refused by the engine (RecipeError); nothing modelled
        freed += saved
        working += saved
    return freed, working


def estimate(resolved, world: int, stages: list[int], dp: int | None,
             edp: int | None, microbatches: int | None, calibration: Calibration | None = None,
             assume_distributed_optimizer: bool = True) -> list[StageMemory]:
    """Memory per GPU of each pipeline stage of a resolved recipe
    (:class:`muse_stack.resolve.recipe.ResolvedRecipe`)."""
    recipe, model = resolved.recipe, resolved.model
    cal = calibration or Calibration()
    compiled = engine_options.is_on(engine_options.resolve(recipe), "compile_elementwise")
    factor = cal.activation_factor_for(compiled)
    lay, batch = recipe.layout, recipe.batch
    tp, pp, etp = lay.tp, lay.pp, lay.etp
    cp = lay.cp or 1
    ep = lay.ep or 1
    sp = bool(lay.sequence_parallel) or (tp > 1 and lay.sequence_parallel is None)
    w_bytes = 4 if recipe.precision == "fp32" else 2
    grad_bytes = 4
    opt_bytes = optimizer_state_bytes(recipe)
    dist_opt = lay.distributed_optimizer if lay.distributed_optimizer is not None else assume_distributed_optimizer
    offload_opt = bool(recipe.offload.optimizer)
    base_frozen = "base" in recipe.frozen or recipe.task == "peft" or recipe.peft is not None

    dense_layer = (m_attn := model.attention_params) // tp + model.latent_projection_params // tp + model.router_params
    del m_attn
    experts_local = model.num_local_experts // ep
    expert_layer = experts_local * model.expert_params // etp
    vocab_part = model.vocab_size * model.hidden_size // tp

    lora_dense = lora_expert = 0
    adapter_act = 0.0  # activation bytes per token and layer that the adapters add (or the frozen base drops)
    settings = resolved.peft
    if settings is not None:
        from muse_stack.models.muse_spark.peft_config import EXPERT_TARGETS, target_shape

        lora_dense, lora_expert = adapter_params_per_layer(settings, model, tp=tp, ep=ep, etp=etp)
        k = model.num_experts_per_tok
        for target in settings.targets:
            slots = k if target in EXPERT_TARGETS else 1
            # A's output [tokens, r] for B's gradient; the dropped input when dropout is on
            adapter_act += slots * w_bytes * settings.rank
            if settings.dropout:
                adapter_act += slots * (w_bytes + 1) * target_shape(target, model)[0] / (tp if target not in
                                                                                          EXPERT_TARGETS else etp)

    from muse_stack.plan.towers import tower_plan

    towers = tower_plan(resolved)
    act = layer_activation_bytes_per_token(model, tp, sp, act_bytes=w_bytes, etp=etp)
    if settings is not None:
        if not settings.expert_targets:
            adapter_act -= act["moe_expert_inputs"]
        act = {**act, "moe": act["moe"] + adapter_act}
    freed, recomputed = selective_bytes_per_token(act, recipe.recompute.modules)
    tokens = (batch.mbs * batch.seq_length // cp) if batch.mbs and batch.seq_length else None
    granularity = recipe.recompute.granularity or "none"
    out: list[StageMemory] = []
    for s, n in enumerate(stages):
        holds = []
        extra = 0
        tower_params = tower_trainable = 0
        if s == 0:
            holds.append("embedding")
            extra += vocab_part
            if towers is not None:
                holds.append("perception towers")
                tower_params, tower_trainable = towers.params, towers.trainable_params
        if s == pp - 1:
            holds.append("output layer")
            extra += vocab_part
        dense = n * dense_layer + extra + tower_params
        experts = n * expert_layer
        params = dense + experts
        if base_frozen:
            trainable_dense = n * lora_dense
            trainable_expert = n * lora_expert
        else:
            trainable_dense, trainable_expert = dense - tower_params + tower_trainable, experts
        weights = params * w_bytes + (trainable_dense + trainable_expert) * w_bytes * (recipe.peft is not None)
        grads = (trainable_dense + trainable_expert) * grad_bytes
        if offload_opt:
            optimizer = 0.0
        else:
            shard_dense = (dp or 1) * cp if dist_opt else 1
            shard_expert = (edp or 1) if dist_opt else 1
            optimizer = trainable_dense * opt_bytes / shard_dense + trainable_expert * opt_bytes / shard_expert
        in_flight = None
        activations = logits = None
        if tokens is not None:
            in_flight = min(pp - s, microbatches) if microbatches else pp - s
            per_layer_full = (act["attention"] + act["moe"]) * tokens
            stored_input = w_bytes * model.hidden_size / (tp if sp else 1) * tokens
            if granularity == "full":
                per_mb = n * stored_input
                working = per_layer_full
            elif granularity == "selective":
                per_mb = n * (per_layer_full - freed * tokens)
                working = recomputed * tokens
            else:
                per_mb = n * per_layer_full
                working = 0
            if s == 0 and towers is not None:  # the towers' own activations, per micro-batch of mbs sequences
                per_mb += batch.mbs * towers.activation_bytes_per_sequence(recipe.recompute_towers())
            activations = (per_mb * in_flight + working) / GIB
            if s == pp - 1:
                logits = tokens * model.vocab_size / tp * cal.logits_bytes / GIB
        static = (weights + grads + optimizer) / GIB
        total = (static + (logits or 0) + factor * (activations or 0) + cal.runtime_overhead_gib
                 if tokens is not None else None)
        out.append(StageMemory(
            stage=s, layers=n, holds=holds, params=params, trainable_params=trainable_dense + trainable_expert,
            dense_params=dense, expert_params=experts, weights_gib=weights / GIB, grads_gib=grads / GIB,
            optimizer_gib=optimizer / GIB, activations_gib=activations, logits_gib=logits,
            buffers_gib=cal.runtime_overhead_gib, activation_factor=factor, total_gib=total,
            microbatches_in_flight=in_flight))
    return out
