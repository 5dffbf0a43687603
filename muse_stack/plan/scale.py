"""Step time and memory of a MoE model's training step at scale, for the shapes of public models.

The model of :mod:`muse_stack.plan.cost` is Muse Spark's; this one prices any decoder of
:class:`muse_stack.plan.published.MoeShape` (GQA or MLA attention, sliding windows, leading dense layers, shared
experts) on a layout of TP, PP with interleaved virtual stages (VP), CP, EP and DP, with the same primitives
(:func:`cost.ring_time`, :func:`cost.alltoall_time`, the machine table's fabrics) and these terms, each named in
the result (:class:`ScaleStep.terms_s`):

* GEMMs (attention projections, dense MLP, router, routed and shared experts, output layer) on the roofline
  ``max(FLOPs / peak, bytes / HBM) / efficiency``; an FP8 run's GEMMs at the datasheet's dense FP8 peak with
  1-byte operands (current scaling and MX alike: the machine table's ``peak_fp8_tflops``), plus the cast of
  each GEMM's input and output gradient (``fp8_cast``: a bf16 read and an fp8 write at HBM bandwidth);
  the efficiency by generation: Hopper's the H200 calibration's (``time.gemm_efficiency_dense``), Blackwell's
  ``scale.gemm_efficiency_sm100`` (fitted to the published GB300 runs, the protocol's fit rows);
* the attention core, ``2 x (query-key + value width) x mean keys`` FLOPs per token (causal, or the sliding
  window's keys), at the BF16 peak and the same efficiency; attention sinks add one logit a head (not priced);
* elementwise work: the layer's activation bytes written once and read once (:data:`ELEMENTWISE_PASSES`:
  the fused kernels' minimum), at HBM bandwidth;
* TP collectives with sequence parallelism, the EP all-to-all (dispatch and combine of the routed slots at the
  hidden width; peers inside the NVLink domain over NVLink, the others over one NIC), the pipeline's
  send/receive per virtual stage;
* host time the GPU waits for (``host_sync``): each MoE layer reads the per-expert token counts back to the host
  before it can size the dispatch, so the host cannot queue work past it. A run that graphs its router and
  preprocessing (``Run.cuda_graphs``) takes ``max(its GPU work, scale.moe_sync_gap_s)`` in a layer's forward,
  fitted to the GB300 rows, which all graph them (the form, "max" rather than a fixed gap per sync, chosen on the
  fit rows alone: rms log error 0.172 against 0.176). A run without CUDA graphs takes ``max(GPU work, host time)``
  in the forward and in the backward, each host time measured for one megatron-core MoE layer without graphs
  (``ScaleCalibration.ungraphed_host_s``: a + b x local experts by pass and precision,
  benchmarks/results/host-sync-probe);
* the pipeline: a GPU of stage ``s`` runs the virtual stages ``s, s + PP, ...``; per micro-batch it works
  ``W_s`` (its chunks' forward and backward); the step's pipeline is ``m x max W_s + (PP - 1) x mean W_s / VP``:
  the slowest stage sets the steady state (``pp_imbalance``: what it costs beyond the mean), and the fill and
  drain pass one chunk of each stage (``pp_bubble``, ``(PP - 1) / (VP x m)`` of the work);
* DP: the distributed optimizer's gradient reduce-scatter and parameter all-gather (bf16; Bridge's runs reduce
  in bf16), dense parameters over DP x CP, expert parameters over the expert-data-parallel group; with
  ``overlap_grad_reduce`` the reduce runs under the last micro-batch's backward, with
  ``overlap_param_gather`` the gather under the first one's forward, but for one bucket each;
* the optimizer step: the Adam update's bytes at its measured share of HBM bandwidth (:mod:`cost`).

Layers are split over the ``PP x VP`` virtual stages as Megatron-Bridge's DeepSeek-V3 layout map does
(``ceil(L / S)`` a stage, the remainder on the last; evenly where that leaves the last empty); the embedding
rides on the first virtual stage, the output layer, loss and any MTP layer on the last.

A published run is priced as it ran (:meth:`Published.run`: the page's columns with the settings Megatron-Bridge's
source gives): its selective recompute runs the recomputed modules' forward again in the backward (MLA's
up-projections, the experts' SwiGLU, the norms, a dense layer's MLP) and keeps less for the backward; its
cross-entropy sets what the logits hold for the backward (:data:`LOGITS_BYTES`); its CUDA graphs choose the host
figure; its dispatcher and A2A overlap are stated in the assumptions and not priced.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from muse_stack.machine.hardware import GpuSpec, gpu_spec
from muse_stack.machine.table import table
from muse_stack.plan import calibration as calibration_file
from muse_stack.plan.cost import (ADAM_BYTES_PER_PARAM, BACKWARD, DDP_BUCKET_PARAMS, TimeCalibration,
                                  alltoall_split, alltoall_time, p2p_time, ring_time)
from muse_stack.plan.fabrics import Links
from muse_stack.plan.memory import Calibration as MemoryCalibration
from muse_stack.plan.published import MoeShape, Published, Run
from muse_stack.util.errors import InputError

BF16 = 2
#: each activation tensor written once by its producer and read once by its consumer: the least HBM traffic
#: of an elementwise chain (TE's fused norms, SwiGLU, RoPE and permutation kernels), derived, not fitted
ELEMENTWISE_PASSES = 2.0
#: bytes of a cast into FP8 per element: the bf16 input read, the fp8 copy written
FP8_CAST_BYTES = BF16 + 1
#: fp32 master weight and two Adam moments per sharded parameter
OPTIMIZER_STATE_BYTES = 12
#: bytes the loss holds per token and vocabulary entry of the logits (the TP rank's share), by the run's
#: cross-entropy (``Run.cross_entropy``). "te-fused": TransformerEngine's parallel_cross_entropy, which
#: megatron-core calls on the output layer's bf16 logits as they are (gpt_model.py:606-608,635 and
#: language_module.py:134-156 at 0d8e0714c), computes the loss and the gradient in one pass, writes the gradient
#: into the logits in place in their own dtype and keeps that tensor, and nothing else of the vocabulary's size, for
#: the backward (transformer_engine/pytorch/triton/cross_entropy.py:172-187,342 and pytorch/cross_entropy.py:50-59,
#: 75-80 at TE v2.9, 70f536662): the bf16 logits alone. "unfused": a loss that upcasts the logits to fp32 and
#: keeps an fp32 softmax apart from the upcast: the bf16 logits and two fp32 copies at its peak (megatron-core's
#: own unfused path softmaxes its fp32 upcast in place, tensor_parallel/cross_entropy.py:28,45,64-65,80 at
#: 0d8e0714c, so for it this is an upper bound by one fp32 copy)
LOGITS_BYTES = {"te-fused": BF16, "unfused": BF16 + 4 + 4}


def _calibrated(name: str):
    return calibration_file.calibrated("scale", name)


class ScaleCalibration(BaseModel):
    """The at-scale terms' constants, entries of muse_stack/plan/calibration.json (``scale``), fitted by
    ``benchmarks/scripts/plan/validate_bridge.py --fit --write`` to the protocol's fit rows only (the published
    GB300 runs, muse_stack/plan/published/bridge-moe.yaml)."""

    model_config = ConfigDict(frozen=True)

    gemm_efficiency_sm100: float = _calibrated("gemm_efficiency_sm100")
    moe_sync_gap_s: float = _calibrated("moe_sync_gap_s")
    # measured, not fitted to any published run: the host time of one MoE layer's forward and backward without CUDA
    # graphs, a + b x local experts per precision (benchmarks/results/host-sync-probe; plan/fit_host.py --write)
    ungraphed_host_fwd_bf16_s: float = _calibrated("ungraphed_host_fwd_bf16_s")
    ungraphed_host_fwd_bf16_per_expert_s: float = _calibrated("ungraphed_host_fwd_bf16_per_expert_s")
    ungraphed_host_bwd_bf16_s: float = _calibrated("ungraphed_host_bwd_bf16_s")
    ungraphed_host_bwd_bf16_per_expert_s: float = _calibrated("ungraphed_host_bwd_bf16_per_expert_s")
    ungraphed_host_fwd_fp8_s: float = _calibrated("ungraphed_host_fwd_fp8_s")
    ungraphed_host_fwd_fp8_per_expert_s: float = _calibrated("ungraphed_host_fwd_fp8_per_expert_s")
    ungraphed_host_bwd_fp8_s: float = _calibrated("ungraphed_host_bwd_fp8_s")
    ungraphed_host_bwd_fp8_per_expert_s: float = _calibrated("ungraphed_host_bwd_fp8_per_expert_s")

    def ungraphed_host_s(self, fp8: bool, local_experts: float) -> tuple[float, float]:
        """(forward, backward) host seconds of one MoE layer with ``local_experts`` experts on the GPU, run
        without CUDA graphs: measured in bf16 and in FP8 current scaling (FP8-MX, which no Hopper GPU runs, takes
        the FP8 figure)."""
        p = "fp8" if fp8 else "bf16"
        return tuple(getattr(self, f"ungraphed_host_{ph}_{p}_s") + local_experts
                     * getattr(self, f"ungraphed_host_{ph}_{p}_per_expert_s") for ph in ("fwd", "bwd"))


class ScaleStep(BaseModel):
    """A published run's predicted step: time by term, memory, and what the model does not express."""

    row: str
    gpu: str
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    microbatches: int
    terms_s: dict[str, float]  #: per step, on the slowest stage's critical path; sums to step_s
    stage_work_s: list[float]  #: per micro-batch, per pipeline stage (forward + backward of its chunks)
    chunk_layers: list[int]  #: decoder layers of each virtual stage
    memory_gib: float
    memory_parts_gib: dict[str, float]
    capacity_gib: float
    fits: bool
    links: str
    assumptions: list[str]


def split_layers(layers: int, stages: int) -> list[int]:
    """Decoder layers of each of ``stages`` virtual stages: ``ceil(L / S)`` each and the remainder on the last
    (Megatron-Bridge's DeepSeek-V3 layout map), or as even as possible where that leaves the last stage empty."""
    if stages <= 1:
        return [layers]
    q = -(-layers // stages)
    last = layers - q * (stages - 1)
    if last > 0:
        return [q] * (stages - 1) + [last]
    base, extra = divmod(layers, stages)
    return [base + 1] * extra + [base] * (stages - extra)


def system_links(published: Published, row: Run) -> tuple[GpuSpec, Links]:
    system = published.systems[row.system]
    spec = gpu_spec(system.machine)
    fabric = table().fabrics[system.inter]
    domain = spec.nvlink_domain if spec.nvlink_domain > system.per_node else min(system.per_node, spec.nvlink_domain)
    return spec, Links(intra=spec.intra, inter=fabric, domain=domain)


def efficiency(spec: GpuSpec, cal: ScaleCalibration, hopper: TimeCalibration) -> float:
    return cal.gemm_efficiency_sm100 if spec.arch == "sm100" else hopper.gemm_efficiency_dense


def estimate(published: Published, row: Run, *, cal: ScaleCalibration | None = None,
             hopper: TimeCalibration | None = None, memory: MemoryCalibration | None = None) -> ScaleStep:
    """The step of ``row``'s layout for its model on its system: a published run as it ran
    (:meth:`Published.run`), or a layout tune tries for it."""
    cal = cal or ScaleCalibration()
    hopper = hopper or TimeCalibration()
    memory = memory or MemoryCalibration()
    shape: MoeShape = published.models[row.model]
    spec, links = system_links(published, row)
    eff = efficiency(spec, cal, hopper)
    fp8 = row.precision != "bf16"
    if fp8 and spec.peak_fp8_tflops is None:
        raise InputError(f"{row.id} runs FP8 GEMMs but the machine row {spec.name} states no FP8 peak",
                         field=f"machines.{spec.name}.gpu.peak_fp8_tflops", value=None,
                         fix="add the datasheet's dense FP8 figure and its source to muse_stack/machine/machines.yaml")
    peak = (spec.peak_fp8_tflops if fp8 else spec.peak_bf16_tflops) * 1e12
    bf16_peak = spec.peak_bf16_tflops * 1e12
    hbm = spec.hbm_gbps * 1e9
    tp, pp, vp, cp, ep, etp = row.tp, row.pp, row.vp, row.cp, row.ep, row.etp
    sp = tp > 1
    t = row.mbs * row.seq / cp  # tokens of a micro-batch on one CP rank
    t_sp = t / tp if sp else t
    h = shape.hidden_size
    assumptions: list[str] = []
    operand = 1 if fp8 else BF16

    def gemm(m: float, k: float, n: float, count: float = 1.0, low: bool = True) -> tuple[float, float]:
        """(GEMM seconds, FP8 cast seconds) of one forward GEMM [m, k] x [k, n]."""
        if m <= 0 or k <= 0 or n <= 0:
            return 0.0, 0.0
        use_fp8 = fp8 and low
        b = operand if use_fp8 else BF16
        flops = 2.0 * m * k * n
        bytes_ = b * (m * k + k * n) + BF16 * m * n
        sec = count * max(flops / (peak if use_fp8 else bf16_peak), bytes_ / hbm) / eff
        # the input cast forward; the backward casts the output gradient (counted here, once per forward)
        cast = count * FP8_CAST_BYTES * (m * k + m * n) / hbm if use_fp8 else 0.0
        return sec, cast

    def layer(i: int) -> dict[str, float]:
        """Forward seconds of decoder layer ``i`` for one micro-batch."""
        out = dict.fromkeys(("dense_gemm", "expert_gemm", "attention", "elementwise", "fp8_cast", "tp_comm",
                             "ep_alltoall", "recompute"), 0.0)

        def add(key: str, pair: tuple[float, float]) -> None:
            out[key] += pair[0]
            out["fp8_cast"] += pair[1]

        for j, (k_in, n_out, split) in enumerate(shape.attention_gemms()):
            pair = gemm(t, k_in, n_out / tp if split else n_out)
            add("dense_gemm", pair)
            if "mla_up_proj" in row.recompute and shape.attention == "mla" and j in (1, 3):
                out["recompute"] += sum(pair)  # the up-projections run again in the backward
        qk, v = shape.attention_dims()
        out["attention"] = 2.0 * (qk + v) / tp * shape.mean_keys(i, row.seq) * t / bf16_peak / eff
        act = BF16 * (3 * h + (shape.q_width + shape.kv_width + shape.v_width + shape.core_out_width) / tp)
        tp_rings = 2  # all-gather before, reduce-scatter after the attention block (SP)
        if shape.is_moe(i):
            e, k, f = shape.num_experts, shape.experts_per_token, shape.moe_ffn_hidden_size
            add("dense_gemm", gemm(t_sp, h, e, low=False))  # the router runs in bf16 (or fp32)
            slots = k * (t / tp) * etp  # routed slots this GPU computes (balanced routing)
            local = e / ep
            per_expert = slots / local
            add("expert_gemm", gemm(per_expert, h, 2 * f / etp, local))
            add("expert_gemm", gemm(per_expert, f / etp, h, local))
            act += BF16 * (2 * h + k * (2 * h + 3 * f) / tp) + 4 * e / tp
            if "moe_act" in row.recompute:  # SwiGLU again: its input read, its output written
                out["recompute"] += BF16 * k * 3 * f / tp * t / hbm
            if shape.shared_ffn_hidden_size:
                fs = shape.shared_ffn_hidden_size
                add("dense_gemm", gemm(t, h, 2 * fs / tp))
                add("dense_gemm", gemm(t, fs / tp, h))
                act += BF16 * 3 * fs / tp
                tp_rings += 2
            out["ep_alltoall"] = 2 * alltoall_time(BF16 * k * (t / tp) * h, ep, ep * etp, links)
        else:
            fd = shape.dense_ffn_hidden_size
            up, down = gemm(t, h, 2 * fd / tp), gemm(t, fd / tp, h)
            add("dense_gemm", up)
            add("dense_gemm", down)
            act += BF16 * (2 * h + 3 * fd / tp)
            tp_rings += 2
            if "mlp" in row.recompute:  # megatron-core recomputes the dense MLP only (not a MoE layer's experts)
                out["recompute"] += sum(up) + sum(down) + ELEMENTWISE_PASSES * BF16 * 3 * fd / tp * t / hbm
        out["elementwise"] = ELEMENTWISE_PASSES * act * t / hbm
        if "layernorm" in row.recompute:  # the two norms again: input read, output written
            out["recompute"] += BF16 * 4 * h * t / hbm
        if tp > 1:
            fabric = links.crossing(tp)
            out["tp_comm"] = tp_rings * ring_time(BF16 * t * h, tp, fabric.gbps, fabric.latency_s)
        return out

    backward = dict(BACKWARD)
    backward["fp8_cast"] = 1.0
    backward["recompute"] = 0.0  # recompute runs once, in the backward
    graphed = bool(row.cuda_graphs)
    host_fwd, host_bwd = cal.ungraphed_host_s(fp8, shape.num_experts / ep)

    def host_wait(fwd: dict[str, float]) -> float:
        """The GPU's idle time at one MoE layer (per micro-batch). The layer reads its per-expert token counts
        back to the host before the dispatch, so the host cannot run ahead past that point, and a pass whose host
        work outlasts its GPU work leaves the GPU waiting. A run that graphs the router and the preprocessing (its
        cuda_graphs) pays the fitted ``moe_sync_gap_s`` against the layer's forward; a run without CUDA graphs
        takes ``max(GPU, host)`` in the forward and in the backward, each host time measured for the layer's
        local experts and precision (``ScaleCalibration.ungraphed_host_s``)."""
        gpu_fwd = sum(v for k, v in fwd.items() if k != "recompute")
        if graphed:
            return max(0.0, cal.moe_sync_gap_s - gpu_fwd)
        gpu_bwd = sum(v * backward[k] for k, v in fwd.items()) + fwd["recompute"]
        return max(0.0, host_fwd - gpu_fwd) + max(0.0, host_bwd - gpu_bwd)

    per_layer = [layer(i) for i in range(shape.num_layers)]
    stages = pp * vp
    chunks = split_layers(shape.num_layers, stages)
    starts = [sum(chunks[:j]) for j in range(stages)]
    # the output layer (and the loss over its logits) on the last virtual stage; MTP's layer there too
    out_gemm, out_cast = gemm(t, h, shape.vocab_size / tp)
    logits = ELEMENTWISE_PASSES * (BF16 + 4) * t * shape.vocab_size / tp / hbm
    mtp = shape.mtp_layers if row.mtp else 0
    moe_layers = [0] * stages
    idle = [0.0] * stages  # the GPU's wait for the host at each MoE layer's forward (see host_wait)
    chunk_fwd: list[dict[str, float]] = []
    for j in range(stages):
        terms = dict.fromkeys(per_layer[0], 0.0)
        for i in range(starts[j], starts[j] + chunks[j]):
            for key, val in per_layer[i].items():
                terms[key] += val
            moe_layers[j] += shape.is_moe(i)
            if shape.is_moe(i):
                idle[j] += host_wait(per_layer[i])
        if j == stages - 1:
            terms["dense_gemm"] += out_gemm * (1 + mtp)
            terms["fp8_cast"] += out_cast * (1 + mtp)
            terms["elementwise"] += logits * (1 + mtp)
            for _ in range(mtp):  # an MTP layer: a decoder layer and its input projection [2H -> H]
                for key, val in per_layer[-1].items():
                    terms[key] += val
                pair = gemm(t, 2 * h, h)
                terms["dense_gemm"] += pair[0]
                terms["fp8_cast"] += pair[1]
                moe_layers[j] += 1
                idle[j] += host_wait(per_layer[-1])
        chunk_fwd.append(terms)
    if mtp:
        assumptions.append("MTP: priced as one more decoder layer, its input projection and one more output layer "
                           "on the last stage; its embedding and loss are not priced apart")
    # pipeline send/receive of the boundary activations (bf16), forward and back, per virtual stage
    p2p_fabric = links.crossing(row.gpus) if pp > 1 else links.intra
    p2p = 2 * p2p_time(BF16 * t_sp * h, p2p_fabric) if pp > 1 else 0.0
    chunk_terms: list[dict[str, float]] = []
    for j, fwd in enumerate(chunk_fwd):
        terms = {key: val * (1 + backward[key]) for key, val in fwd.items()}
        terms["pp_p2p"] = p2p
        terms["host_sync"] = idle[j]
        chunk_terms.append(terms)
    stage_terms = []
    for s in range(pp):
        terms = dict.fromkeys(chunk_terms[0], 0.0)
        for j in range(s, stages, pp):
            for key, val in chunk_terms[j].items():
                terms[key] += val
        stage_terms.append(terms)
    work = [sum(st.values()) for st in stage_terms]
    slow = max(range(pp), key=lambda s: work[s])
    m = row.microbatches
    mean_w = sum(work) / pp
    pipeline = m * work[slow] + (pp - 1) * mean_w / vp
    terms_s = {key: m * val for key, val in stage_terms[slow].items()}
    terms_s["pp_bubble"] = (pp - 1) * mean_w / vp
    # what the slowest stage costs beyond the mean is inside its terms; stated apart for the breakdown
    imbalance = m * (work[slow] - mean_w)

    # parameters one GPU of each stage holds
    def stage_params(s: int) -> tuple[float, float]:
        dense = expert = 0.0
        for j in range(s, stages, pp):
            for i in range(starts[j], starts[j] + chunks[j]):
                split = sum(k_in * n_out / (tp if sp_ else 1) for k_in, n_out, sp_ in shape.attention_gemms())
                dense += shape.dense_params(i) - shape.attention_params + split
                expert += shape.layer_expert_params(i) / (ep * etp)
        vocab = shape.vocab_size * h / tp
        if s == 0:
            dense += vocab
        if s == pp - 1:
            dense += vocab * (1 + mtp)
            if mtp:
                last = shape.num_layers - 1
                dense += shape.dense_params(last) + 2 * h * h
                expert += shape.layer_expert_params(last) / (ep * etp)
        return dense, expert

    params = [stage_params(s) for s in range(pp)]
    dense_p = max(d for d, _ in params)
    expert_p = max(x for _, x in params)
    dp = row.dp
    edp = row.gpus // (pp * ep * etp)
    stage_span = row.gpus // pp
    dp_fabric = links.crossing(stage_span) if dp * cp > 1 else links.intra

    def reduce_gather(n: float, group: int) -> tuple[float, float, float]:
        if group <= 1 or n <= 0:
            return 0.0, 0.0, 0.0
        buckets = math.ceil(n / DDP_BUCKET_PARAMS)
        one = ring_time(BF16 * n, group, dp_fabric.gbps) + buckets * dp_fabric.latency_s
        return one, one, one / buckets

    dense_rg, expert_rg = reduce_gather(dense_p, dp * cp), reduce_gather(expert_p, edp)
    reduce_s, gather_s = dense_rg[0] + expert_rg[0], dense_rg[1] + expert_rg[1]
    bucket = max(dense_rg[2], expert_rg[2])
    w_fwd = sum(v for j in range(slow, stages, pp) for k, v in chunk_fwd[j].items() if k != "recompute")
    w_bwd = work[slow] - w_fwd
    # Bridge's presets: overlap_grad_reduce on; overlap_param_gather on unless the row says not
    reduce_exposed = max(bucket, reduce_s - w_bwd) if reduce_s > 0 else 0.0
    gather_exposed = (max(bucket, gather_s - w_fwd) if row.overlap_param_gather else gather_s) if gather_s > 0 else 0.0
    terms_s["dp_comm"] = reduce_exposed + gather_exposed
    opt_params = dense_p / (dp * cp) + expert_p / edp
    terms_s["optimizer"] = opt_params * ADAM_BYTES_PER_PARAM / hopper.adam_bandwidth_te / hbm
    step = pipeline + terms_s["dp_comm"] + terms_s["optimizer"]
    tokens = row.gbs * row.seq
    tps = tokens / step / row.gpus
    flops = shape.training_flops_per_token(row.seq, row.mtp)

    # memory of the most loaded GPU: stage 0 holds the most micro-batches in flight
    gemm_weights = 1 if fp8 else 0  # an FP8 copy of each GEMM weight (MX: per direction; counted once)
    static = []
    for s in range(pp):
        d, x = params[s]
        static.append((BF16 + BF16 + gemm_weights) * (d + x) + OPTIMIZER_STATE_BYTES * (d / (dp * cp) + x / edp))
    inflight = min(m * vp, 2 * (pp - 1) + (vp - 1) * pp + 1) if vp > 1 else min(m, pp)
    norm_out = 0 if "layernorm" in row.recompute else h  # a norm's output, kept for its consumer's backward
    if shape.attention == "mla" and "mla_up_proj" in row.recompute:
        attn = shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim + shape.core_out_width
    else:
        attn = shape.q_width + shape.kv_width + shape.v_width + shape.core_out_width
    per_layer_act = []
    for i in range(shape.num_layers):
        # per token, bf16: the block's input and its norm's output, what the attention core keeps (q, k, v and
        # its output, or the latents when the up-projections are recomputed), then the MLP's
        saved = BF16 * (h + norm_out + attn / tp)
        if shape.is_moe(i):
            k, f = shape.experts_per_token, shape.moe_ffn_hidden_size
            swiglu_out = 0 if "moe_act" in row.recompute else f
            saved += BF16 * (h + norm_out + k * (h + 2 * f + swiglu_out) / tp + 3 * shape.shared_ffn_hidden_size / tp)
            saved += 4 * shape.num_experts  # the router's fp32 scores
        else:  # the dense MLP's input, and its intermediates unless it is recomputed
            mlp_kept = 0 if "mlp" in row.recompute else 3 * shape.dense_ffn_hidden_size / tp
            saved += BF16 * (h + norm_out + mlp_kept)
        per_layer_act.append(saved * t)
    # the chunks of stage 0 (one micro-batch each), times the chunk-micro-batches it holds at once
    act0 = sum(per_layer_act[starts[j] + i] for j in range(0, stages, pp) for i in range(chunks[j])) / vp
    activations = inflight * act0
    logits_b = LOGITS_BYTES[row.cross_entropy] * t * shape.vocab_size / tp if pp == 1 else 0.0
    gib = 2 ** 30
    parts = {"weights_grads_optimizer": max(static) / gib, "activations": activations / gib,
             "logits": logits_b / gib, "runtime": memory.runtime_overhead_gib}
    total = sum(parts.values())
    system = published.systems[row.system]
    local, remote = alltoall_split(ep, ep * etp, links.domain)
    assumptions += [
        "balanced routing (the runs force-balance the token distribution among experts)",
        (f"host time of a MoE layer's forward {cal.moe_sync_gap_s * 1e3:.2f} ms (scale.moe_sync_gap_s, fitted to the "
         "GB300 rows, which graph the router and preprocessing as this run does): a layer's forward takes at least "
         "that long" if graphed else
         f"host time of a MoE layer without CUDA graphs, {shape.num_experts // ep} local experts, "
         f"{'FP8' if fp8 else 'bf16'}: {host_fwd * 1e3:.2f} ms forward and {host_bwd * 1e3:.2f} ms backward "
         "(scale.ungraphed_host_*, measured by benchmarks/scripts/plan/host_sync_probe.py: megatron-core 0.19's "
         "alltoall MoE layer on an x86 host of one H100, the MoE block only; "
         + ("FP8-MX takes the FP8 current-scaling figure; " if row.precision == "fp8-mx" else "")
         + "this run's host and megatron-core may differ); each pass takes at least that long"),
        f"expert all-to-all over {ep} ranks: {local} peers over {links.intra.name}, {remote} over "
        f"{links.inter.name} ({system.note})",
        f"dispatcher: {row.dispatcher} (the run's); its specifics are not expressed: every dispatcher is priced as "
        "an all-to-all of the routed slots at the hidden width in bf16",
        "A2A overlap: " + ("on in the run (overlap_moe_expert_parallel_comm, delay_wgrad_compute), not priced: the "
                           "all-to-all is priced in line with compute" if row.a2a_overlap
                           else "off in the run, as priced: the all-to-all in line with compute"),
        "CUDA graphs: " + (f"the run graphs {', '.join(row.cuda_graphs)} (TransformerEngine): priced only as the "
                           "choice of host figure (the graphed runs' fitted one), not scope by scope" if row.cuda_graphs
                           else "none in the run: the host times measured without graphs"),
        f"selective recompute of {row.recompute or 'nothing'} (the run's): one more forward of the "
        "recomputed GEMMs and elementwise work",
        "activation memory: the tensors each layer keeps for its backward, counted (no fitted factor: the "
        "memory calibration's factor is of this project's engine)",
        f"cross-entropy: {row.cross_entropy} (the run's): the logits held for the backward at "
        f"{LOGITS_BYTES[row.cross_entropy]} bytes a token and vocabulary entry"
        + (" (the gradient written into the bf16 logits in place)" if row.cross_entropy == "te-fused" else "")
        + ("" if pp == 1 else "; they are the last stage's, not in stage 0's memory counted here"),
        "attention sinks add one logit per head: not priced" if shape.attention_sinks else "",
        f"DP: bf16 reduce-scatter and all-gather over {dp_fabric.name}; gradient reduce under the last micro-batch's "
        "backward" + ("; parameter gather under the first one's forward" if row.overlap_param_gather
                      else "; parameter gather exposed (overlap_param_gather off)"),
        f"layers per virtual stage {chunks}; the embedding on the first, the output layer on the last",
    ]
    return ScaleStep(
        row=row.id, gpu=spec.name, step_s=step, tokens_per_s_per_gpu=tps,
        mfu=flops * tps / bf16_peak, microbatches=m, terms_s=terms_s, stage_work_s=work, chunk_layers=chunks,
        memory_gib=total, memory_parts_gib=parts, capacity_gib=spec.memory_gib, fits=total <= spec.memory_gib,
        links=f"{links.intra.describe()} inside {links.domain} GPUs, {links.inter.describe()} across",
        assumptions=[a for a in assumptions if a] + [f"pipeline: {imbalance:.3f} s of the slowest stage's time is "
                                                     "stage imbalance (beyond the mean stage)"])


class Candidate(BaseModel):
    """One layout tune tried for a published run's GPU count, its prediction and whether it fits."""

    tp: int
    pp: int
    vp: int
    ep: int
    mbs: int
    tokens_per_s_per_gpu: float
    memory_gib: float
    dominant: str  #: the largest term of its step
    published: bool = False  #: the published layout

    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp} VP{self.vp} EP{self.ep} MBS{self.mbs}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tune(published: Published, row: Run, *, cal: ScaleCalibration | None = None,
         hopper: TimeCalibration | None = None, memory: MemoryCalibration | None = None) -> list[Candidate]:
    """Every layout of ``row``'s GPU count, model, batch and sequence that is predicted to fit, fastest first:
    TP of 1, 2, 4 or 8 (dividing the heads), PP dividing the GPUs with at least one layer a stage, VP with at
    least one layer a virtual stage (1 without PP; up to 24), EP dividing the experts and a stage's GPUs, MBS of
    1, 2, 4 or 8 that divides the batch over DP. CP and ETP stay as published."""
    shape = published.models[row.model]
    cal = cal or ScaleCalibration()
    hopper = hopper or TimeCalibration()
    memory = memory or MemoryCalibration()
    heads = shape.num_attention_heads if shape.attention == "mla" else shape.num_key_value_heads
    out: list[Candidate] = []
    for tp in (1, 2, 4, 8):
        if heads % tp or tp > 8:
            continue
        for pp in _divisors(row.gpus // tp):
            if pp > shape.num_layers or (row.gpus // (tp * pp)) % row.cp:
                continue
            for vp in ([1] if pp == 1 else [v for v in (1, 2, 3, 4, 6, 8, 12, 24) if pp * v <= shape.num_layers]):
                stage_gpus = row.gpus // pp
                for ep in (e for e in _divisors(shape.num_experts) if stage_gpus % (e * row.etp) == 0):
                    dp = row.gpus // (tp * pp * row.cp)
                    for mbs in (1, 2, 4, 8):
                        if row.gbs % (mbs * dp):
                            continue
                        trial = row.model_copy(update={"tp": tp, "pp": pp, "vp": vp, "ep": ep, "mbs": mbs})
                        step = estimate(published, trial, cal=cal, hopper=hopper, memory=memory)
                        mine = (tp, pp, vp, ep, mbs) == (row.tp, row.pp, row.vp, row.ep, row.mbs)
                        if not step.fits and not mine:
                            continue
                        out.append(Candidate(tp=tp, pp=pp, vp=vp, ep=ep, mbs=mbs,
                                             tokens_per_s_per_gpu=step.tokens_per_s_per_gpu,
                                             memory_gib=step.memory_gib,
                                             dominant=max(step.terms_s, key=lambda k: step.terms_s[k]),
                                             published=mine))
    out.sort(key=lambda c: -c.tokens_per_s_per_gpu)
    return out
