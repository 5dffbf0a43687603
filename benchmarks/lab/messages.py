"""The collective messages one training step of a recipe sends, by kind, group size and bytes.

The step-time model (:mod:`muse_stack.plan.cost`) prices these collectives, from its own byte counts,
with a link bandwidth and an efficiency; ``benchmarks/scripts/comm.py`` measures them at these sizes
on a machine's links. Per micro-batch of ``t`` tokens on one CP rank:

* ``tp_allgather`` / ``tp_reducescatter``: with sequence parallelism, the bf16 activations
  ``t x H`` gathered before and scattered after the attention block and the latent projections
  (two of each per layer in the forward);
* ``ep_alltoall``: dispatch and combine, each GPU sending its routed slots
  ``top-k x t / TP x Hm`` in bf16;
* ``pp_sendrecv``: the fp32 residual stream ``t x H`` between two pipeline stages (``t / TP x H``
  with sequence parallelism: megatron-core's pipeline tensor shape);
* ``dp_reducescatter`` / ``dp_allgather`` (dense parameters, over DP) and ``edp_*`` (expert
  parameters, over the expert-data-parallel group): the distributed optimizer's gradient
  reduce-scatter (fp32 gradients) and parameter all-gather (bf16) of one bucket, megatron-core's
  default bucket of 40 M parameters or the stage's parameters if fewer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: bytes per element
BF16, FP32 = 2, 4
#: megatron-core's default DDP bucket (parameters)
DDP_BUCKET_PARAMS = 40_000_000


@dataclass(frozen=True)
class Message:
    kind: str  #: tp_allgather, tp_reducescatter, ep_alltoall, pp_sendrecv, [e]dp_reducescatter, [e]dp_allgather
    group: int  #: ranks in the collective (2 for a send/recv pair)
    bytes: int  #: per rank: the full tensor of an all-gather's output / reduce-scatter's input; an all-to-all's send buffer
    per_step: int  #: how many a step sends (forward and backward, all micro-batches, this rank's layers)

    def as_dict(self) -> dict:
        return asdict(self)


def step_messages(recipe) -> list[Message]:
    """The messages of one step of ``recipe`` on one rank of its first pipeline stage."""
    from muse_stack.recipes.layout import data_parallel, expert_data_parallel, micro_batches
    from muse_stack.resolve.recipe import finalize

    resolved = finalize(recipe)
    model = resolved.model
    lay, batch = recipe.layout, recipe.batch
    tp, pp, cp, ep = lay.tp, lay.pp, lay.cp or 1, lay.ep or 1
    dp = lay.dp or data_parallel(recipe.hardware.count, lay) or 1
    split = resolved.stages
    micro = micro_batches(batch.gbs, batch.mbs, dp)
    if not batch.seq_length or micro is None or split is None:
        return []
    t = batch.mbs * batch.seq_length // cp
    layers = split[0]
    h, hm, k = model.hidden_size, model.moe_hidden_size, model.num_experts_per_tok
    out: list[Message] = []
    if tp > 1:
        sp = lay.sequence_parallel if lay.sequence_parallel is not None else True
        if sp:  # forward: 2 all-gathers and 2 reduce-scatters a layer; backward the mirror images
            out.append(Message("tp_allgather", tp, BF16 * t * h, 4 * layers * micro))
            out.append(Message("tp_reducescatter", tp, BF16 * t * h, 4 * layers * micro))
    if ep > 1:  # dispatch and combine, forward and backward
        out.append(Message("ep_alltoall", ep, BF16 * k * (t // tp) * hm, 4 * layers * micro))
    if pp > 1:  # activation forward, gradient backward; megatron-core's pipeline shape splits t over TP with SP
        sp = tp > 1 and (lay.sequence_parallel if lay.sequence_parallel is not None else True)
        out.append(Message("pp_sendrecv", 2, FP32 * (t // tp if sp else t) * h, 2 * micro))
    # the dense parameters shard over DP, the experts over the expert-data-parallel group
    edp = expert_data_parallel(recipe.hardware.count, lay) or 1
    for prefix, group, params in (
            ("dp", dp, layers * model.dense_params_per_layer // tp),
            ("edp", edp, layers * model.num_local_experts * model.expert_params // (ep * lay.etp))):
        if group > 1 and params:
            bucket = min(DDP_BUCKET_PARAMS, params)
            buckets = -(-params // bucket)
            out.append(Message(f"{prefix}_reducescatter", group, FP32 * bucket, buckets))
            out.append(Message(f"{prefix}_allgather", group, BF16 * bucket, buckets))
    return out


#: NCCL-tests' bus-bandwidth factor: bytes each rank moves over its links per byte of message
BUS_FACTOR = {
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "allreduce": lambda n: 2 * (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}


def bus_gbps(op: str, group: int, nbytes: int, seconds: float) -> float:
    """Bus bandwidth (GB/s) as NCCL's tests define it: algorithm bandwidth x the op's factor."""
    return nbytes / seconds / 1e9 * BUS_FACTOR[op](group)
