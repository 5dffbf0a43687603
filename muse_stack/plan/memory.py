"""Per-GPU memory estimate for one pipeline stage of a megatron-core run.

Bytes per parameter follow megatron-core's mixed-precision training: bf16 weights (2 B),
fp32 gradient buffers (4 B), and Adam's fp32 master weights plus two moments (12 B), the
last sharded over the data-parallel group with the distributed optimizer. Expert parameters
shard over the expert-data-parallel group, world / (EP x ETP x PP), dense parameters over
DP x CP. Activations follow the layer's formulas (see :func:`layer_activation_bytes_per_token`)
under the recompute setting, times the micro-batches a 1F1B pipeline stage keeps in flight.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from muse_stack.model_config import ModelConfig
from muse_stack.recipes.schema import Recipe

GIB = 2**30


class Calibration(BaseModel):
    """Terms the formulas do not derive: runtime buffers and allocator slack.

    Defaults are the values measured on an H200 with megatron-core + TE (benchmarks/); they
    are stated in every plan.
    """

    model_config = ConfigDict(frozen=True)

    # Fitted to the peak allocated memory (torch.cuda.max_memory_allocated) of the megatron-core
    # engine on H200 in benchmarks/{proxy-1gpu,proxy-2gpu,slice-1gpu,slice-1gpu-mbs2}/results.json
    # (least squares of peak against the modelled live bytes; see benchmarks/README.md): the
    # estimate lands within 3% of each. The CUDA context and NCCL's own buffers sit outside the
    # caching allocator and are not in these peaks.
    runtime_overhead_gib: float = 1.5  # cuBLAS/TE workspaces and other allocations outside the formulas
    allocator_slack: float = 0.08  # fitted share over the modelled live tensors (the least-squares slope)
    logits_bytes: int = 10  # per logit on the last stage: fp32 logits, their gradient, bf16 copy
    # Policy, not a measurement: the estimate is of allocated memory (what the calibration above was
    # fitted to); a plan fits only if this share of the GPU stays free for what that leaves out:
    # the CUDA context, NCCL's communicator buffers and the caching allocator's fragmentation.
    headroom_fraction: float = 0.10
    source: str = "H200 megatron-core measurements, benchmarks/README.md 'Planner calibration'"


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
    activations_gib: float | None
    logits_gib: float | None
    buffers_gib: float
    total_gib: float | None
    microbatches_in_flight: int | None


def layer_activation_bytes_per_token(m: ModelConfig, tp: int, sp: bool, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one token leaves stored in one decoder layer for the backward pass (no recompute).

    Tensors outside the TP-split regions are divided by TP only with sequence parallelism.
    """
    h, hm, i, k, e = m.hidden_size, m.moe_hidden_size, m.moe_intermediate_size, m.num_experts_per_tok, m.num_local_experts
    hq, hkv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    seq_div = tp if sp else 1
    b = act_bytes
    # outside TP regions: input norm, residual gate math (fp32 stream), post-attn norm
    attn_outside = (b * h + 4 * h + b * h + b * h) / seq_div
    # inside: q,k,v projections, normed/rotated q,k, output gate, attention output, gated output
    attn_inside = b * ((hq + 2 * hkv) + (hq + hkv) + hq + hq + 2 * hq) / tp
    moe_outside = (b * h + 4 * e * 2 + 4 * h + b * h * 3) / seq_div
    moe_latent = b * (2 * hm + hm) / seq_div
    # each routed slot (a GPU receives k slots per local token on average): dispatched input, gate_up out, activation, product, down out, post-expert norm
    moe_slots = k * b * (hm + 2 * i + i + i + hm + hm) / seq_div
    return {
        "attention": attn_outside + attn_inside,
        "attention_inside": attn_inside,
        "moe": moe_outside + moe_latent + moe_slots,
    }


def estimate(recipe: Recipe, model: ModelConfig, world: int, stages: list[int], dp: int | None,
             edp: int | None, microbatches: int | None, calibration: Calibration | None = None,
             assume_distributed_optimizer: bool = True) -> list[StageMemory]:
    cal = calibration or Calibration()
    lay, batch = recipe.layout, recipe.batch
    tp, pp, etp = lay.tp, lay.pp, lay.etp
    cp = lay.cp or 1
    ep = lay.ep or 1
    sp = bool(lay.sequence_parallel) or (tp > 1 and lay.sequence_parallel is None)
    w_bytes = 4 if recipe.precision == "fp32" else 2
    grad_bytes = 4
    opt_bytes = 8 if recipe.precision == "fp32" else 12
    if recipe.optimizer.name == "sgd":
        opt_bytes = 0 if recipe.precision == "fp32" else 4
    dist_opt = lay.distributed_optimizer if lay.distributed_optimizer is not None else assume_distributed_optimizer
    offload_opt = bool(recipe.offload.optimizer)
    base_frozen = "base" in recipe.frozen or recipe.task == "peft"

    dense_layer = (m_attn := model.attention_params) // tp + model.latent_projection_params // tp + model.router_params
    del m_attn
    experts_local = model.num_local_experts // ep
    expert_layer = experts_local * model.expert_params // etp
    vocab_part = model.vocab_size * model.hidden_size // tp

    lora_dense = lora_expert = 0
    if recipe.peft is not None:
        r = recipe.peft.rank
        h, hm, i = model.hidden_size, model.moe_hidden_size, model.moe_intermediate_size
        hq, hkv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
        shapes = {"self_attn.q_proj": (h, hq), "self_attn.k_proj": (h, hkv), "self_attn.v_proj": (h, hkv),
                  "self_attn.o_proj": (hq, h), "self_attn.gate_proj": (h, hq), "mlp.pre_expert_proj": (h, hm),
                  "mlp.post_expert_proj": (hm, h)}
        for target in recipe.peft.targets:
            if target in shapes:
                a, c = shapes[target]
                lora_dense += r * (a + c) // tp
            elif target == "mlp.experts.gate_up_proj":
                lora_expert += experts_local * r * (hm + 2 * i)
            elif target == "mlp.experts.down_proj":
                lora_expert += experts_local * r * (i + hm)

    act = layer_activation_bytes_per_token(model, tp, sp, act_bytes=w_bytes)
    tokens = (batch.mbs * batch.seq_length // cp) if batch.mbs and batch.seq_length else None
    granularity = recipe.recompute.granularity or "none"
    out: list[StageMemory] = []
    for s, n in enumerate(stages):
        holds = []
        extra = 0
        if s == 0:
            holds.append("embedding")
            extra += vocab_part
            if recipe.frozen or recipe.data.kind == "multimodal":
                holds.append("perception towers (not counted)")
        if s == pp - 1:
            holds.append("output layer")
            extra += vocab_part
        dense = n * dense_layer + extra
        experts = n * expert_layer
        params = dense + experts
        if base_frozen:
            trainable_dense = n * lora_dense
            trainable_expert = n * lora_expert
        else:
            trainable_dense, trainable_expert = dense, experts
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
                per_mb = n * (per_layer_full - act["attention_inside"] * tokens)
                working = act["attention_inside"] * tokens
            else:
                per_mb = n * per_layer_full
                working = 0
            activations = (per_mb * in_flight + working) / GIB
            if s == pp - 1:
                logits = tokens * model.vocab_size / tp * cal.logits_bytes / GIB
        live = (weights + grads + optimizer) / GIB + (activations or 0) + (logits or 0)
        total = live * (1 + cal.allocator_slack) + cal.runtime_overhead_gib if tokens is not None else None
        out.append(StageMemory(
            stage=s, layers=n, holds=holds, params=params, trainable_params=trainable_dense + trainable_expert,
            dense_params=dense, expert_params=experts, weights_gib=weights / GIB, grads_gib=grads / GIB,
            optimizer_gib=optimizer / GIB, activations_gib=activations, logits_gib=logits,
            buffers_gib=cal.runtime_overhead_gib, total_gib=total, microbatches_in_flight=in_flight))
    return out
