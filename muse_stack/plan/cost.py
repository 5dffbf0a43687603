"""Step time of a megatron-core training step, term by term, before a GPU-hour is spent.

Every term is a formula over the layout, the model's shapes, the GPU's datasheet figures
(:mod:`muse_stack.machine.hardware`) and the published bus bandwidths of the links the collectives cross
(:mod:`muse_stack.plan.fabrics`, each figure cited); the only fitted constants are the kernel efficiencies,
HBM passes and fixed times of :class:`TimeCalibration`, fitted by ``benchmarks/scripts/plan/fit_time.py``
to this project's H200 measurements in ``benchmarks/`` and to nothing else, and read from
``muse_stack/plan/calibration.json`` (:mod:`muse_stack.plan.calibration`).

One micro-batch on one pipeline stage costs, per decoder layer (forward; backward is twice the
forward for GEMMs and elementwise work, 2.5 x for attention, which recomputes QK^T):

* dense GEMMs (q/k/v/gate/o projections, latent projections, router) and grouped expert GEMMs,
  each ``max(FLOPs / peak, bytes / HBM) / efficiency``: the roofline makes the time depend on
  the GEMM's shape (an expert that receives few tokens is bandwidth-bound);
* attention: ``4 x heads/TP x head_dim x mean keys x tokens`` FLOPs (sliding or full, per
  sequence when rows are packed) at the attention efficiency;
* elementwise and norm work: the layer's activation bytes (the memory model's formulas) read and
  written ``passes`` times at HBM bandwidth, fewer passes when the chains are compiled;
* host time: a fixed time per layer and pass, plus one per local expert (kernel launches and
  host work), and one per micro-batch and stage. The host does not wait for a kernel it launches
  (CUDA launches are asynchronous: the host enqueues, the GPU drains the stream in order), so the
  host time runs alongside the GPU work it launches instead of adding to it. One micro-batch on one
  stage costs ``max(GPU work, host time)``: the GPU work when the queue stays full (the host runs
  ahead, the GPU never waits for a launch), the host time when the kernels are shorter than their
  launches (the GPU idles between them). The GPU work is every other term here, the collectives
  included (NCCL's kernels run on the GPU's streams);
* the token dispatcher's permutation (``dispatch``): the routed slots at the latent width
  (``2 x top-k x tokens/TP x ETP x latent`` bytes) gathered into expert order and scattered back,
  read and written ``passes`` times at HBM bandwidth, the passes by dispatcher: the allgather
  dispatcher permutes by index with no token exchange at EP 1; the alltoall dispatcher adds its
  exchange buffers and the sort of each rank's chunks into local-expert order (flex is priced as
  alltoall); backward moves the same bytes again. At EP > 1 the exchange itself is the EP term
  below, priced as an all-to-all whichever the dispatcher (the allgather dispatcher's gather of
  every EP rank's tokens is not modelled apart);
* recompute: one more forward of what is recomputed (all of it under full recompute; selective
  ``moe_act`` and ``moe`` rerun the share of the elementwise work their activations are);
* TP collectives with sequence parallelism: all-gather and reduce-scatter of the hidden states
  around the attention block and the latent projections, ring time
  ``fixed + (TP-1)/TP x bytes / bus bandwidth``;
* the EP all-to-all: dispatch and combine of ``top-k x tokens x latent width`` bytes, the share
  bound for GPUs of the same NVLink domain over NVLink, the rest over the GPU's one NIC, both at
  once;
* the CP exchange (A2A: q, k, v and the output; P2P: the K/V ring of full-attention layers).

Which fabric a group crosses follows from megatron-core's rank order (TP innermost, PP
outermost): a group inside one NVLink domain runs on NVLink, else on the scale-out NIC, at the
bus bandwidth and fixed time per collective of :mod:`muse_stack.plan.fabrics`. No collective
overlaps compute: the recipes configure no overlap (stated in every plan's assumptions).

Adapters on a frozen base (a ``peft`` block): the base GEMMs' backward computes data gradients
only (1 x the forward instead of 2 x: no weight gradients), and the adapters' own GEMMs (``x A^T``
then ``h B^T``, rank r; per local expert for expert targets) run forward, with both gradients in
the backward, on the same roofline.

An image-text recipe's first stage also runs the perception towers (:mod:`muse_stack.plan.towers`)
on each micro-batch's images: the vision tower's GEMMs (patch embedding, q/k/v/proj, MLP) and the
projector's on the same roofline, its attention at the attention efficiency; backward 2 x the
forward for a part that trains and none for a frozen one (nothing upstream of the towers trains),
and one more forward of the vision tower where its blocks are recomputed (``recompute.towers``, on by
default under full recompute), as the memory model counts them; and their memory traffic outside the GEMMs
and attention, the bytes per patch counted by running their code (:func:`tower_elementwise_time`). Their
FLOPs join the MFU (:func:`muse_stack.models.muse_spark.flops.tower_flops_per_sequence`).

A 1F1B pipeline of ``m`` micro-batches over stages of per-micro-batch time ``t_s`` (``max(GPU work,
host time)``, the GPU work including the
point-to-point send of the boundary activations, in the engine's fp32 pipeline dtype and
megatron-core's pipeline shape, over EFA/InfiniBand once the world exceeds one NVLink domain)
takes ``(m - 1) x max t_s + sum t_s / VPP``: the slowest stage sets the steady state, the fill
and drain pass every stage once (uneven first and last stages enter through ``t_s``). After it
come the distributed optimizer's gradient reduce-scatter (fp32) and parameter all-gather (bf16)
over the DP group, one of each per DDP bucket, counted exposed (no overlap is configured by the
recipes), and the optimizer step: 30 bytes of HBM traffic per sharded parameter (fp32 master,
two moments read and written, gradient read, bf16 weight written) at the share of the HBM bandwidth
its kernel measured alone (TE's ``multi_tensor_adam`` or the engine's Triton step, :class:`StepKernels`),
plus by optimizer layout:

* megatron-core's own layout (``optimizer.precision_aware`` off): after the update the fp32 master
  shards are copied into the bf16 weights, 6 bytes per sharded parameter (fp32 read, bf16
  written) moved ``optimizer_copy_passes`` times at HBM bandwidth; TE's precision-aware FusedAdam
  writes the bf16 weights in its update kernel and has no such pass;
* int16 remainders (``optimizer.param_remainders``): the master is rebuilt from the bf16 weight and
  its remainder and split back in the kernel, priced as the remainders' 4 bytes per sharded
  parameter (read and written) moved ``remainder_passes`` times at HBM bandwidth.

Where the engine runs a kernel of its own in place of the stack's (:func:`step_kernels`, the same
checks as the engine's), the model prices the one that runs: the Adam update above; the post-expert
norm's backward (6 bytes an element of the routed slots at the latent width, one call a layer and
micro-batch, at its kernel's measured share: TorchInductor's compiled chain or the engine's one
pass; an eager chain's is inside the eager passes); and the word embedding's gradient on the first
stage at the HBM bandwidth (megatron-core's dense table gradient and DDP's add, or the engine's adds
into main_grad; none for a frozen table).

The passes of the dispatcher and the optimizer layouts are fitted by ``fit_time.py --sweep`` to a
sweep of one machine that varies them (``h200.sh plansweep``), with the efficiency and the fixed
times; a pass fitted to 0 makes its term vanish.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from muse_stack.models.muse_spark.flops import mean_keys_causal, mean_keys_sliding, training_flops_per_token
from muse_stack.machine.hardware import GpuSpec
from muse_stack.models.muse_spark.config import ModelConfig
from muse_stack.plan import calibration as calibration_file
from muse_stack.plan.fabrics import Fabric, Links
from muse_stack.plan.memory import layer_activation_bytes_per_token
from muse_stack.recipes import options as engine_options
from muse_stack.recipes.schema import Recipe

#: bytes of HBM traffic per sharded parameter in one Adam step of the distributed optimizer
ADAM_BYTES_PER_PARAM = 30
BF16 = 2
#: the pipeline dtype of the megatron engine (engines/mcore/config.py: the residual stream crosses
#: stages in fp32)
PIPELINE_DTYPE, PIPELINE_BYTES = "fp32", 4
#: megatron-core's default DDP bucket (parameters)
DDP_BUCKET_PARAMS = 40_000_000


def _calibrated(name: str):
    """A default of TimeCalibration read from muse_stack/plan/calibration.json (``time.<name>``)."""
    return calibration_file.calibrated("time", name)


class TimeCalibration(BaseModel):
    """Kernel efficiencies, HBM passes and fixed times of the step-time model. Each default is an entry
    of muse_stack/plan/calibration.json, with the benchmark folder it came from and the command that
    writes it (:mod:`muse_stack.plan.calibration`). The GPU terms' H200 values are
    ``benchmarks/scripts/plan/fit_time.py --sweep``'s fit to one machine's sweep of slice-1gpu as
    shipped and each neighbour of its settings (``h200.sh plansweep``; least squares on the relative
    error, each unknown at or above its bound; benchmarks/results/plan-sweep/fit.json is its output).
    The sweep's runs are GPU-bound and hide the host time, so the host times (per layer pass, per
    micro-batch, per local expert) and the eager passes, which the sweep does not separate, are the
    fit to the older H200 runs of benchmarks/ (``fit_time.PRIOR``, fit_time.py without ``--sweep``:
    its proxy-model runs are host-bound; other machines and stacks than the sweep's). fit_time.py
    without ``--sweep`` checks this calibration on those runs (benchmarks/results/plan/fit_time.json,
    ``adopted_error`` and ``adopted_leave_one_out_error``)."""

    model_config = ConfigDict(frozen=True)

    # one efficiency for dense GEMMs, expert GEMMs and attention: fitted apart, the H200 runs do
    # not identify them (fit_time.py); the roofline in gemm_time still tells the shapes apart
    gemm_efficiency_dense: float = _calibrated("gemm_efficiency_dense")
    gemm_efficiency_expert: float = _calibrated("gemm_efficiency_expert")
    attention_efficiency: float = _calibrated("attention_efficiency")
    # HBM passes over the activation bytes: eager (the older runs': the sweep is compiled), and with
    # fusions.compile_elementwise
    elementwise_passes: float = _calibrated("elementwise_passes")
    elementwise_passes_compiled: float = _calibrated("elementwise_passes_compiled")
    # host time (launches and host work; it overlaps the GPU work, see estimate_step), fitted to the
    # older runs (the sweep is GPU-bound): per decoder layer and forward pass (backward counts 2), per
    # micro-batch and stage (forward and backward together), and per local expert, decoder layer and
    # forward pass (grouped GEMM launches)
    layer_overhead_s: float = _calibrated("layer_overhead_s")
    microbatch_overhead_s: float = _calibrated("microbatch_overhead_s")
    expert_overhead_s: float = _calibrated("expert_overhead_s")
    # HBM passes over the routed slots' latent bytes per layer and forward pass, by dispatcher
    # (permute and unpermute; fit_time.py --sweep; flex is priced as alltoall)
    dispatch_passes_allgather: float = _calibrated("dispatch_passes_allgather")
    dispatch_passes_alltoall: float = _calibrated("dispatch_passes_alltoall")
    # HBM passes over the optimizer layout's extra bytes per sharded parameter and step (fit_time.py
    # --sweep): megatron-core's fp32 master -> bf16 weight copy (6 B, precision_aware off), and the int16
    # remainders read and written (4 B, param_remainders on)
    optimizer_copy_passes: float = _calibrated("optimizer_copy_passes")
    remainder_passes: float = _calibrated("remainder_passes")
    # Measured, not fitted: the share of the HBM bandwidth a kernel the engine chooses between reached
    # alone on an H200 (its minimum bytes over its median time, over the datasheet's HBM bandwidth; held
    # on other GPUs), at the launch the engine ships. The Adam update over one MoE layer's experts, TE's
    # multi_tensor_adam at its default chunk and the engine's Triton step (performance.triton_adam)
    # (benchmarks/results/adam/kernels.json; adam_choose.py launch --write):
    adam_bandwidth_te: float = _calibrated("adam_bandwidth_te")
    adam_bandwidth_triton: float = _calibrated("adam_bandwidth_triton")
    # the post-expert norm's backward at the slice's shape, TorchInductor's row pass and column sum and
    # the engine's one Triton pass (benchmarks/results/normbwd/kernels.json; normbwd_choose.py launch --write):
    norm_backward_bandwidth_compiled: float = _calibrated("norm_backward_bandwidth_compiled")
    norm_backward_bandwidth_one_pass: float = _calibrated("norm_backward_bandwidth_one_pass")
    # Not fitted (no measurement in benchmarks/ resolves it): collectives run at the published bus
    # bandwidth of the fabric they cross (muse_stack/machine/machines.yaml), times this factor.
    link_efficiency: float = 1.0
    source: str = ("H200 step times of one machine's sweep of slice-1gpu and its neighbours, "
                   "benchmarks/results/plan-sweep/fit.json (GPU terms); the host times and eager passes of "
                   "the older H200 runs of benchmarks/ (fit_time.PRIOR)")


class TermTimes(BaseModel):
    """Seconds per micro-batch of one stage (forward + backward + recompute), by term."""

    dense_gemm: float = 0.0
    expert_gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    recompute: float = 0.0
    dispatch: float = 0.0  # the token dispatcher's permutation (HBM)
    tp_comm: float = 0.0
    ep_alltoall: float = 0.0
    cp_comm: float = 0.0
    pp_p2p: float = 0.0
    towers: float = 0.0  # the perception towers (first stage of an image-text recipe)
    # the host time (per layer pass, per local expert, per micro-batch) the GPU work does not hide:
    # max(0, host - the terms above), so that the stage costs max(GPU work, host time)
    host_exposed: float = 0.0

    def total(self) -> float:
        return sum(self.model_dump().values())


class CommTerm(BaseModel):
    """One communication term of a step: what it sends, over which fabric, at what bandwidth."""

    term: str
    seconds: float  #: per step, on the slowest stage's critical path (dp_comm: after the pipeline)
    collective: str
    group: int
    fabrics: list[Fabric]
    bytes_per_collective: float  #: per rank (0 where the term mixes sizes)
    per_layer_forward_s: float = 0.0

    def describe(self) -> str:
        links = ", ".join(f.describe() for f in self.fabrics) or "none"
        return f"{self.collective}, group {self.group}, over {links}"


class StepTime(BaseModel):
    gpu: str
    step_s: float
    tokens_per_step: int
    tokens_per_s_per_gpu: float
    mfu: float | None
    mfu_6n: float | None
    usd_per_million_tokens: float | None
    terms_s: dict[str, float]  # per step, on the critical path; sums to step_s
    dominant: str
    stage_s: list[float]  # per micro-batch, per stage: max(stage_gpu_s, stage_host_s)
    stage_gpu_s: list[float] = []  # per micro-batch, per stage: the GPU work (every term but host_exposed)
    stage_host_s: list[float] = []  # per micro-batch, per stage: the host time (launches and host work)
    microbatches: int
    assumptions: list[str]
    calibration: TimeCalibration
    kernels: StepKernels | None = None  #: the engine's kernel choices priced
    communication: list[CommTerm] = []  #: the communication terms of terms_s, each with its fabric


def gemm_time(m: float, k: float, n: float, spec: GpuSpec, efficiency: float, count: float = 1.0) -> float:
    """Forward time of ``count`` GEMMs [m, k] x [k, n] in bf16: the roofline over the efficiency."""
    if m <= 0 or k <= 0 or n <= 0 or count <= 0:
        return 0.0
    flops = 2.0 * m * k * n
    bytes_ = BF16 * (m * k + k * n + m * n)
    return count * max(flops / (spec.peak_bf16_tflops * 1e12), bytes_ / (spec.hbm_gbps * 1e9)) / efficiency


def ring_time(bytes_: float, group: int, gbps: float, latency_s: float = 0.0) -> float:
    """An all-gather or reduce-scatter of a ``bytes_`` tensor over ``group`` ranks on a ring at
    bus bandwidth ``gbps``: each rank moves ``(group - 1) / group`` of the tensor, after the
    collective's fixed ``latency_s``."""
    if group <= 1:
        return 0.0
    return latency_s + (group - 1) / group * bytes_ / (gbps * 1e9)


def nvlink_reach(spec: GpuSpec, per_node: int) -> int:
    """GPUs one GPU reaches over NVLink: its node on HGX systems, the whole NVLink domain where
    the domain spans nodes (GB200 NVL72: 72 GPUs over 18 trays of 4)."""
    domain = spec.nvlink_domain or per_node
    return domain if domain > spec.per_node_default else min(per_node, domain)


def spec_links(spec: GpuSpec, per_node: int) -> Links:
    """The fabrics of the machine ``spec`` (its row of ``muse_stack/machine/machines.yaml``: the
    scale-out fabric is the one the launcher sets up) with ``per_node`` GPUs per node."""
    return Links(intra=spec.intra, inter=spec.inter, domain=nvlink_reach(spec, per_node))


def alltoall_split(group: int, span: int, domain: int) -> tuple[int, int]:
    """(peers over NVLink, peers over the scale-out network) of one rank of an all-to-all over
    ``group`` ranks ``span / group`` apart, in NVLink domains of ``domain`` consecutive ranks."""
    if group <= 1:
        return 0, 0
    stride = max(span // group, 1)
    local = max(1, min(group, domain // stride)) - 1
    return local, group - 1 - local


def alltoall_time(bytes_out: float, group: int, span: int, links: Links, eff: float = 1.0) -> float:
    """An all-to-all in which each GPU sends ``bytes_out`` spread evenly over ``group`` ranks
    (itself included). The group's ranks sit ``span / group`` apart; peers inside the GPU's
    NVLink domain are reached over NVLink, the others over one of the GPU's NICs (an all-to-all does
    not aggregate NICs: fabrics.ALLTOALL_ONE_NIC), both at once; the collective's fixed time is
    that of the slower fabric it crosses."""
    local, remote = alltoall_split(group, span, links.domain)
    if local + remote == 0:
        return 0.0
    per_peer = bytes_out / group
    latency = links.inter.latency_s if remote else links.intra.latency_s
    return latency + max(local * per_peer / (links.intra.gbps * 1e9 * eff),
                         remote * per_peer / (links.inter.alltoall_gbps * 1e9 * eff))


def p2p_time(bytes_: float, fabric: Fabric, eff: float = 1.0) -> float:
    """One send/receive of ``bytes_`` over ``fabric``."""
    if bytes_ <= 0:
        return 0.0
    return fabric.latency_s + bytes_ / (fabric.gbps * 1e9 * eff)


def group_links(span: int, links: Links) -> Fabric:
    """The fabric of a ring over ranks that cover ``span`` consecutive ranks: NVLink inside one
    domain, else the scale-out network (its slowest hop sets a ring's pace)."""
    return links.crossing(span)


def embedding_grad_time(kind: str, model: ModelConfig, spec: GpuSpec, tokens: float, tp: int) -> float:
    """Seconds per micro-batch of the word embedding's gradient on the first stage, at the HBM
    bandwidth (no measurement of it alone): megatron-core's dense table gradient and DDP's add
    (``dense``), or the engine's adds into main_grad (``main_grad``); none for a frozen table."""
    width = model.hidden_size
    if kind == "dense":
        bytes_ = (model.vocab_size / tp * EMBEDDING_DENSE_TABLE_BYTES + tokens * EMBEDDING_DENSE_TOKEN_BYTES) * width
    elif kind == "main_grad":
        bytes_ = tokens * EMBEDDING_MAIN_GRAD_TOKEN_BYTES * width
    else:
        return 0.0
    return bytes_ / (spec.hbm_gbps * 1e9)


def layer_terms(model: ModelConfig, spec: GpuSpec, cal: TimeCalibration, *, tokens: int, tp: int, cp: int, ep: int,
                etp: int, sp: bool, compiled: bool, full_attention: bool, seq_lens: Sequence[int],
                cp_comm_type: str | None, per_node: int, links: Links | None = None,
                dispatcher: str | None = None) -> dict[str, float]:
    """Forward seconds of one decoder layer for one micro-batch of ``tokens`` tokens (per CP rank).
    ``dispatcher``: the recipe's ``layout.dispatcher`` (unset: megatron-core's alltoall, as the
    engine configures it)."""
    links = links or spec_links(spec, per_node)
    eff = cal.link_efficiency
    h, hm, i = model.hidden_size, model.moe_hidden_size, model.moe_intermediate_size
    e, k = model.num_local_experts, model.num_experts_per_tok
    hq, hkv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    t = tokens
    t_sp = t / tp if sp else t
    dense = (gemm_time(t, h, (2 * hq + 2 * hkv) / tp, spec, cal.gemm_efficiency_dense)
             + gemm_time(t, hq / tp, h, spec, cal.gemm_efficiency_dense)
             + gemm_time(t, h, hm / tp, spec, cal.gemm_efficiency_dense)
             + gemm_time(t, hm / tp, h, spec, cal.gemm_efficiency_dense)
             + gemm_time(t_sp, h, e, spec, cal.gemm_efficiency_dense))
    local_experts = e / ep
    slots = k * (t / tp) * etp  # routed slots a GPU computes (balanced routing)
    per_expert = slots / local_experts
    expert = (gemm_time(per_expert, hm, 2 * i / etp, spec, cal.gemm_efficiency_expert, local_experts)
              + gemm_time(per_expert, i / etp, hm, spec, cal.gemm_efficiency_expert, local_experts))
    # attention: queries of this CP rank against the mean keys of their sequences
    total = sum(seq_lens)
    keys = (sum((mean_keys_causal(s) if full_attention else mean_keys_sliding(s, model.sliding_window)) * s
                for s in seq_lens) / total) if total else 0.0
    attention = 4.0 * (hq / tp) * keys * t / (spec.peak_bf16_tflops * 1e12) / cal.attention_efficiency
    act = layer_activation_bytes_per_token(model, tp, sp, etp=etp)
    passes = cal.elementwise_passes_compiled if compiled else cal.elementwise_passes
    elementwise = passes * (act["attention"] + act["moe"]) * t / (spec.hbm_gbps * 1e9)
    # the dispatcher's permutation: the routed slots at the latent width, gathered into expert
    # order and scattered back (each read and written once per pass)
    dispatch_passes = (cal.dispatch_passes_allgather if dispatcher == "allgather"
                       else cal.dispatch_passes_alltoall)
    dispatch = dispatch_passes * BF16 * slots * hm / (spec.hbm_gbps * 1e9)
    # TP with SP: all-gather before and reduce-scatter after the attention block and the latent
    # projections; without SP the same volume as two all-reduces
    tp_bytes = BF16 * t * h
    tp_fabric = group_links(tp, links)
    tp_comm = 4 * ring_time(tp_bytes, tp, tp_fabric.gbps * eff, tp_fabric.latency_s)
    # EP: dispatch and combine, each GPU sends its routed slots at the latent width
    ep_bytes = BF16 * k * (t / tp) * hm
    ep_comm = 2 * alltoall_time(ep_bytes, ep, ep * etp, links, eff)
    cp_comm = 0.0
    if cp > 1:
        cp_span = tp * cp
        if cp_comm_type in ("a2a", "a2a+p2p") or not full_attention:
            a2a_bytes = BF16 * t * (2 * hq + 2 * hkv) / tp  # q, k, v in, the output back
            cp_comm = alltoall_time(a2a_bytes, cp, cp_span, links, eff)
        else:
            kv_bytes = BF16 * t * 2 * hkv / tp
            cp_comm = (cp - 1) * p2p_time(kv_bytes, group_links(cp_span, links), eff)
    return {"dense_gemm": dense, "expert_gemm": expert, "attention": attention, "elementwise": elementwise,
            "layer_overhead": cal.layer_overhead_s + cal.expert_overhead_s * local_experts, "dispatch": dispatch,
            "tp_comm": tp_comm, "ep_alltoall": ep_comm, "cp_comm": cp_comm}


#: backward / forward time of each term (GEMMs: data and weight gradients; attention: FlashAttention's
#: backward recomputes QK^T; SP's backward gathers the input again for the weight gradient; the
#: dispatcher's backward permutes the gradients as the forward permuted the tokens)
BACKWARD = {"dense_gemm": 2.0, "expert_gemm": 2.0, "attention": 2.5, "elementwise": 2.0, "layer_overhead": 2.0,
            "dispatch": 1.0, "tp_comm": 1.5, "ep_alltoall": 1.0, "cp_comm": 2.0}


#: the terms of layer_terms that are host time (launches and host work), not GPU work: they run
#: alongside the GPU work (asynchronous launches), see estimate_step
HOST = ("layer_overhead",)

#: backward / forward of the base GEMMs under a frozen base: data gradients only
FROZEN_BACKWARD = {"dense_gemm": 1.0, "expert_gemm": 1.0, "tp_comm": 1.0}


def adapter_terms(settings, model: ModelConfig, spec: GpuSpec, cal: TimeCalibration, *, tokens: int, tp: int,
                  ep: int, etp: int) -> dict[str, float]:
    """Forward seconds of one decoder layer's adapter GEMMs for one micro-batch: dense targets on
    the layer's tokens (A whole and B split over TP on column-parallel linears, A split and B whole
    on row-parallel ones, whole on the latent projections), expert targets on each local expert's
    routed slots (balanced routing)."""
    from muse_stack.models.muse_spark.peft_config import EXPERT_TARGETS, local_shape

    r = settings.rank
    local = model.num_local_experts / ep
    per_expert = model.num_experts_per_tok * (tokens / tp) * etp / local
    dense = expert = 0.0
    for target in settings.targets:
        k_in, n_out = local_shape(target, model, tp=tp, etp=etp)
        if target in EXPERT_TARGETS:
            expert += (gemm_time(per_expert, k_in, r, spec, cal.gemm_efficiency_expert, local)
                       + gemm_time(per_expert, r, n_out, spec, cal.gemm_efficiency_expert, local))
        else:
            dense += (gemm_time(tokens, k_in, r, spec, cal.gemm_efficiency_dense)
                      + gemm_time(tokens, r, n_out, spec, cal.gemm_efficiency_dense))
    return {"dense_gemm": dense, "expert_gemm": expert}


def tower_time(plan, spec: GpuSpec, cal: TimeCalibration, *, sequences: int, recomputed: bool) -> float:
    """Seconds of the perception towers for one micro-batch of ``sequences`` sequences, forward,
    backward and recompute (see the module docstring); ``plan`` a :class:`~muse_stack.plan.towers.TowerPlan`;
    ``recomputed``: the vision tower's blocks run their forward again in the backward (``recompute_towers()``)."""
    if plan is None or not plan.image_tokens_per_sequence:
        return 0.0
    towers = plan.towers
    v = towers.vision_config
    d, i = v.hidden_size, v.intermediate_size
    tokens = sequences * plan.image_tokens_per_sequence
    frame = plan.image_tokens_per_sequence * v.merge_size**2
    patches = tokens * v.merge_size**2
    eff = cal.gemm_efficiency_dense
    layer = (gemm_time(patches, d, 3 * d, spec, eff) + gemm_time(patches, d, d, spec, eff)
             + gemm_time(patches, d, i, spec, eff) + gemm_time(patches, i, d, spec, eff))
    window = min(v.window_patches**2, frame)
    keys = sum(frame if kind == "full_attention" else window for kind in v.layer_types)
    vision = (gemm_time(patches, v.patch_dim, d, spec, eff) + v.num_hidden_layers * layer
              + 4.0 * d * keys * patches / (spec.peak_bf16_tflops * 1e12) / cal.attention_efficiency)
    p = towers.projector_hidden_size
    projector = (gemm_time(tokens, towers.out_hidden_size, p, spec, eff) + gemm_time(tokens, p, p, spec, eff)
                 + gemm_time(tokens, p, plan.text_hidden_size, spec, eff))
    vision_total = vision * (1 + 2 * plan.vision_trains + (recomputed and plan.vision_trains))
    return (vision_total + projector * (1 + 2 * plan.projector_trains)
            + tower_elementwise_time(plan, spec, sequences=sequences, recomputed=recomputed))


def tower_elementwise_time(plan, spec: GpuSpec, *, sequences: int, recomputed: bool) -> float:
    """Seconds of the towers' memory traffic outside their GEMMs and attention for one micro-batch of
    ``sequences`` sequences: the bytes per patch counted by running their code, forward, backward and
    recomputed forward (:meth:`~muse_stack.plan.towers.TowerPlan.traffic_bytes_per_patch`), times the
    patches, at the datasheet HBM bandwidth. The bytes are those the ops read and write, so no pass count
    applies; no share of the bandwidth is applied either: the calibration holds a measured share only for
    the engine's own kernels (Adam, the norm's backward), none for eager elementwise kernels, whose passes
    (``elementwise_passes``) the decoder prices at the full bandwidth too. A lower bound where eager
    kernels reach less."""
    if plan is None or not plan.image_tokens_per_sequence:
        return 0.0
    patches = sequences * plan.image_tokens_per_sequence * plan.towers.vision_config.merge_size**2
    return plan.traffic_bytes_per_patch(recomputed) * patches / (spec.hbm_gbps * 1e9)


def recomputed_share(granularity: str, modules: list[str] | None, act: dict[str, float]) -> dict[str, float]:
    """Which forward terms run again in the backward pass, as shares of each term. Selective
    recompute of ``moe_act`` or ``moe`` reruns the elementwise work in proportion to the
    activation bytes the module frees (``act``: the memory model's per-token bytes)."""
    if granularity == "full":
        return dict.fromkeys(BACKWARD, 1.0)
    share: dict[str, float] = {}
    if granularity == "selective":
        layer_bytes = act["attention"] + act["moe"]
        for name in modules or ["core_attn"]:
            if name == "core_attn":
                share["attention"] = 1.0
            elif name == "moe_act":
                share["elementwise"] = max(share.get("elementwise", 0.0), act["recompute_moe_act"] / layer_bytes)
            elif name == "moe":
                share.update({"expert_gemm": 1.0, "ep_alltoall": 1.0, "dispatch": 1.0,
                              "elementwise": max(share.get("elementwise", 0.0), act["recompute_moe"] / layer_bytes)})
    return share


#: bytes per sharded parameter of megatron-core's copy of the fp32 master into the bf16 weight
MASTER_COPY_BYTES = 4 + BF16
#: bytes per sharded parameter of the int16 remainders, read and written by the update
REMAINDER_BYTES = 2 + 2


def layout_bytes_per_param(cal: TimeCalibration, precision_aware: bool, remainders: bool) -> float:
    """HBM bytes per sharded parameter and step that the optimizer layout adds to the Adam update's
    (each layout's bytes times its fitted passes): megatron-core's master copy without the
    precision-aware optimizer, the int16 remainders with it."""
    if not precision_aware:
        return cal.optimizer_copy_passes * MASTER_COPY_BYTES
    return cal.remainder_passes * REMAINDER_BYTES if remainders else 0.0


#: bytes of HBM traffic per element of the post-expert norm's backward: its input and the incoming
#: gradient read, the input's gradient written (bf16; the routing weight's and the gain's gradients are
#: a row's and a column's worth)
NORM_BACKWARD_BYTES = 3 * BF16
#: megatron-core's dense lookup gradient, per table element and micro-batch: the bf16 gradient zeroed,
#: then read by DDP's add, which reads and writes the fp32 main gradient; and per token element: the
#: incoming bf16 gradient read and its row of the table written
EMBEDDING_DENSE_TABLE_BYTES = BF16 + BF16 + 4 + 4
EMBEDDING_DENSE_TOKEN_BYTES = BF16 + BF16
#: the engine's lookup that adds into main_grad, per token element: the bf16 gradient read, its fp32
#: copy written and read, the main gradient's row read and written (at most one row per token)
EMBEDDING_MAIN_GRAD_TOKEN_BYTES = BF16 + 4 + 4 + 4 + 4


class StepKernels(BaseModel):
    """The kernels of a megatron step where the engine runs one of its own in place of the stack's:
    the Adam update, the word embedding's gradient and the post-expert norm's backward. The planner
    prices each by its bytes at the bandwidth share it measured (``TimeCalibration``)."""

    model_config = ConfigDict(frozen=True)

    adam: Literal["te", "triton"]  #: TE's multi_tensor_adam, or the engine's Triton step
    #: megatron-core's dense table gradient, the engine's adds into main_grad, or none (a frozen table)
    embedding_grad: Literal["dense", "main_grad", "frozen"]
    #: the compiled chain's (TorchInductor; eager: inside the eager passes), or the engine's one Triton pass
    post_expert_norm_backward: Literal["compiled", "one_pass"]

    def describe(self) -> str:
        adam = {"te": "TE's multi_tensor_adam", "triton": "the engine's Triton step"}[self.adam]
        emb = {"dense": "megatron-core's dense table gradient", "main_grad": "added into main_grad by the engine",
               "frozen": "none (frozen)"}[self.embedding_grad]
        norm = {"compiled": "the compiled chain's", "one_pass": "the engine's one Triton pass"}[
            self.post_expert_norm_backward]
        return f"Adam update: {adam}; word embedding's gradient: {emb}; post-expert norm's backward: {norm}"


def step_kernels(recipe: Recipe) -> StepKernels:
    """The kernels the megatron engine runs for ``recipe``: each priced engine option's choice as the engine
    resolves it (:func:`muse_stack.recipes.options.kernels`: on where it applies, unset), and no embedding
    gradient at all where the table is frozen (adapters)."""
    chosen = engine_options.kernels(recipe)
    if recipe.peft is not None:
        chosen["embedding_grad"] = "frozen"
    return StepKernels(**chosen)


def estimate_step(resolved, spec: GpuSpec, world: int, stages: list[int], dp: int,
                  edp: int | None, microbatches: int, stage_params: list[tuple[int, int]],
                  cal: TimeCalibration | None = None, seq_lens: Sequence[int] | None = None,
                  links: Links | None = None, kernels: StepKernels | None = None) -> StepTime:
    """Step time of a resolved recipe (:class:`muse_stack.resolve.recipe.ResolvedRecipe`) on ``world``
    GPUs of ``spec``. ``stage_params``: (dense, expert)
    trainable parameters held by one GPU of each stage (the memory plan's figures). ``links``:
    the fabrics, by default those of the recipe's machine (:func:`spec_links`).
    ``kernels``: the engine's kernel choices, by default those it makes for the recipe
    (:func:`step_kernels`; a fit to runs of an older engine gives the kernels they ran)."""
    recipe, model = resolved.recipe, resolved.model
    cal = cal or TimeCalibration()
    kernels = kernels or step_kernels(recipe)
    lay, batch = recipe.layout, recipe.batch
    tp, pp, cp, ep, etp = lay.tp, lay.pp, lay.cp or 1, lay.ep or 1, lay.etp
    vpp = lay.vpp or 1
    sp = bool(lay.sequence_parallel) or (tp > 1 and lay.sequence_parallel is None)
    per_node = recipe.hardware.per_node
    options = engine_options.resolve(recipe)
    compiled = engine_options.is_on(options, "compile_elementwise")
    overlap = engine_options.is_on(options, "overlap_grad_reduce")
    assumptions: list[str] = []
    links = links or spec_links(spec, per_node)
    eff = cal.link_efficiency
    seq = batch.seq_length
    tokens = batch.mbs * seq // cp
    if seq_lens is None:
        seq_lens = [seq] * batch.mbs
        if batch.packed:
            assumptions.append("attention: packed rows taken as one sequence each (an upper bound; the "
                               "sequence lengths are the data's)")
    types = model.resolved_layer_types
    full_share = sum(1 for x in types if x == "full_attention") / len(types)
    common = dict(tokens=tokens, tp=tp, cp=cp, ep=ep, etp=etp, sp=sp, compiled=compiled, seq_lens=seq_lens,
                  cp_comm_type=lay.cp_comm_type, per_node=per_node, links=links, dispatcher=lay.dispatcher)
    full = layer_terms(model, spec, cal, full_attention=True, **common)
    slide = layer_terms(model, spec, cal, full_attention=False, **common)
    fwd = {key: full_share * full[key] + (1 - full_share) * slide[key] for key in full}
    rec = recomputed_share(recipe.recompute.granularity or "none", recipe.recompute.modules,
                           layer_activation_bytes_per_token(model, tp, sp, etp=etp))
    settings = resolved.peft
    backward = dict(BACKWARD)
    adapters = dict.fromkeys(("dense_gemm", "expert_gemm"), 0.0)
    if settings is not None:
        backward.update(FROZEN_BACKWARD)
        adapters = adapter_terms(settings, model, spec, cal, tokens=tokens, tp=tp, ep=ep, etp=etp)
    # the adapters' backward computes both their weight and their input gradients: 2 x the forward
    per_layer = {key: fwd[key] * (1 + backward[key]) + 3 * adapters.get(key, 0.0) for key in fwd}
    per_layer["recompute"] = sum((fwd[key] + adapters.get(key, 0.0)) * share for key, share in rec.items()
                                 if key not in HOST)
    # the post-expert norm's backward over the routed slots at the latent width (one call a layer and
    # micro-batch), at its kernel's measured bandwidth; an eager chain's is inside the eager passes
    norm_bw = (cal.norm_backward_bandwidth_one_pass if kernels.post_expert_norm_backward == "one_pass"
               else cal.norm_backward_bandwidth_compiled if compiled else 0.0)
    if norm_bw > 0:
        slots = model.num_experts_per_tok * (tokens / tp) * etp
        per_layer["elementwise"] += NORM_BACKWARD_BYTES * slots * model.moe_hidden_size / (
            spec.hbm_gbps * 1e9 * norm_bw)
    # host time of a layer: its forward, backward and recomputed forward's launches
    host_layer = sum(per_layer.pop(key) + fwd[key] * rec.get(key, 0.0) for key in HOST)
    # pipeline boundary: the hidden states forward, their gradient back, in megatron-core's
    # pipeline tensor shape (the sequence split over TP with SP) and the engine's pipeline dtype
    p2p_bytes = PIPELINE_BYTES * (tokens / tp if sp else tokens) * model.hidden_size
    # stage s holds ranks [s x world/pp, (s+1) x world/pp): beyond one NVLink domain some
    # boundary leaves it, and that slowest boundary is priced for every stage
    p2p_fabric = links.intra if (pp == 1 or world <= links.domain) else links.inter
    p2p = 0.0 if pp == 1 else 2 * vpp * p2p_time(p2p_bytes, p2p_fabric, eff)
    out_gemm = gemm_time(tokens, model.hidden_size, model.vocab_size / tp, spec, cal.gemm_efficiency_dense) * (
        1 + backward["dense_gemm"])  # the output layer: frozen too under adapters
    from muse_stack.plan.towers import tower_plan

    towers = tower_plan(resolved)  # its stated choices are the plan's assumptions (planner.make_plan)
    towers_s = tower_time(towers, spec, cal, sequences=batch.mbs, recomputed=recipe.recompute_towers())
    if towers is not None and towers.image_tokens_per_sequence:
        recomputed = recipe.recompute_towers()
        towers_ew = tower_elementwise_time(towers, spec, sequences=batch.mbs, recomputed=recomputed)
        counted = "muse_stack/plan/tower_traffic.json" if towers.traffic()[1] else "counted now: not in that file"
        assumptions.append(
            f"perception towers: {towers.traffic_bytes_per_patch(recomputed) / 1e6:.1f} MB per patch "
            f"moved outside the GEMMs and attention (norms, casts, RoPE, GELU, gathers; forward and backward), counted "
            f"by running their code ({counted}), at the full HBM bandwidth: {towers_ew:.3f} s of the towers' "
            f"{towers_s:.3f} s per micro-batch")
    stage_terms: list[TermTimes] = []
    stage_gpu: list[float] = []
    stage_host: list[float] = []
    for s, n in enumerate(stages):
        terms = {key: n * val for key, val in per_layer.items()}
        if s == 0:
            terms["towers"] = towers_s
            terms["elementwise"] += embedding_grad_time(kernels.embedding_grad, model, spec, tokens, tp)
        if s == len(stages) - 1:
            terms["dense_gemm"] += out_gemm
        terms["pp_p2p"] = p2p if pp > 1 else 0.0
        gpu = sum(terms.values())
        host = n * host_layer + cal.microbatch_overhead_s
        # asynchronous launches: the stage costs max(gpu, host); the breakdown keeps every GPU term
        # whole and adds the host time the GPU work does not hide
        terms["host_exposed"] = max(0.0, host - gpu)
        stage_terms.append(TermTimes(**terms))
        stage_gpu.append(gpu)
        stage_host.append(host)
    stage_s = [st.total() for st in stage_terms]
    slow = max(range(len(stage_s)), key=lambda j: stage_s[j])
    steady = microbatches * stage_s[slow]
    pipeline = (microbatches - 1) * stage_s[slow] + sum(stage_s) / vpp
    bubble = pipeline - steady
    # distributed optimizer over the DP group: fp32 gradient reduce-scatter, bf16 parameter all-gather
    dense_p = max(d for d, _ in stage_params)
    expert_p = max(x for _, x in stage_params)
    dist_opt = lay.distributed_optimizer is not False
    dp_span = tp * cp * dp
    dp_fabric = group_links(dp_span, links)
    edp_ = edp or 1
    edp_fabric = group_links(world // pp, links)
    grad_b, param_b = 4, BF16

    def dp_time(params: float, group: int, fabric: Fabric) -> tuple[float, float, float]:
        """Per DDP bucket: a reduce-scatter of the fp32 gradients and an all-gather of the bf16
        parameters (distributed optimizer), or an all-reduce of the gradients (2 x the ring).
        Returns (gradient reduce, parameter gather, one bucket's gradient reduce)."""
        if group <= 1 or params <= 0:
            return 0.0, 0.0, 0.0
        buckets = -(-params // DDP_BUCKET_PARAMS)
        if dist_opt:
            reduce = buckets * fabric.latency_s + ring_time(params * grad_b, group, fabric.gbps * eff)
            gather = buckets * fabric.latency_s + ring_time(params * param_b, group, fabric.gbps * eff)
        else:
            reduce, gather = buckets * fabric.latency_s + 2 * ring_time(params * grad_b, group, fabric.gbps * eff), 0.0
        return reduce, gather, reduce / buckets

    dense_dp, expert_dp = dp_time(dense_p, dp * cp, dp_fabric), dp_time(expert_p, edp_, edp_fabric)
    reduce_s, gather_s = dense_dp[0] + expert_dp[0], dense_dp[1] + expert_dp[1]
    if overlap and reduce_s > 0:
        # megatron-core DDP's overlap_grad_reduce: each bucket is reduced as soon as the last
        # micro-batch's backward has filled it, so the reduce runs under that backward (the slowest
        # stage's, its GPU terms' backward share); the last bucket's reduce follows the backward and
        # stays exposed. The parameter all-gather still follows the optimizer (no overlap_param_gather).
        last = stages[slow]
        hide = last * sum(fwd[key] * backward[key] for key in fwd if key not in HOST) \
            + (out_gemm * backward["dense_gemm"] / (1 + backward["dense_gemm"]) if slow == len(stages) - 1 else 0.0)
        reduce_s = max(max(dense_dp[2], expert_dp[2]), reduce_s - hide)
        assumptions.append("overlap_grad_reduce: the DDP gradient reduce runs under the last micro-batch's backward "
                           "but for its last bucket; the parameter all-gather follows the optimizer")
    dp_comm = reduce_s + gather_s
    opt_params = dense_p / (dp * cp) + expert_p / edp_ if dist_opt else dense_p + expert_p
    opt = recipe.optimizer
    # the Adam update's bytes at its kernel's share of the bandwidth, the layout's own at the full bandwidth
    adam_bw = cal.adam_bandwidth_triton if kernels.adam == "triton" else cal.adam_bandwidth_te
    opt_bytes = ADAM_BYTES_PER_PARAM / adam_bw + layout_bytes_per_param(cal, bool(opt.precision_aware),
                                                                         bool(opt.param_remainders))
    optimizer = opt_params * opt_bytes / (spec.hbm_gbps * 1e9) if not recipe.offload.optimizer else 0.0
    assumptions.append(f"kernels: {kernels.describe()}; the Adam update and the norm's backward at the share of "
                       "the HBM bandwidth each measured alone on an H200, the embedding's gradient at the full "
                       "bandwidth")
    if lay.dispatcher == "flex" and cal.dispatch_passes_alltoall:
        assumptions.append("dispatch: the flex dispatcher's permutation priced as the alltoall dispatcher's")
    step = pipeline + dp_comm + optimizer
    terms_s = {key: microbatches * val for key, val in stage_terms[slow].model_dump().items()}
    terms_s["pp_bubble"] = bubble
    terms_s["dp_comm"] = dp_comm
    terms_s["optimizer"] = optimizer
    per_layer_fwd = {key: fwd[key] for key in ("tp_comm", "ep_alltoall", "cp_comm")}
    ep_local, ep_remote = alltoall_split(ep, ep * etp, links.domain)
    ep_fabrics = [f for f, n in ((links.intra, ep_local), (links.inter, ep_remote)) if n]
    comm = [
        CommTerm(term="tp_comm", seconds=terms_s["tp_comm"], group=tp if tp > 1 else 1,
                 collective="TP all-gather + reduce-scatter (SP)" if sp else "TP all-reduce",
                 fabrics=[group_links(tp, links)] if tp > 1 else [],
                 bytes_per_collective=BF16 * tokens * model.hidden_size,
                 per_layer_forward_s=per_layer_fwd["tp_comm"]),
        CommTerm(term="ep_alltoall", seconds=terms_s["ep_alltoall"], group=ep,
                 collective=f"EP all-to-all, dispatch + combine ({ep_local} peers on NVLink, {ep_remote} off it)",
                 fabrics=ep_fabrics, bytes_per_collective=BF16 * model.num_experts_per_tok * (tokens / tp)
                 * model.moe_hidden_size, per_layer_forward_s=per_layer_fwd["ep_alltoall"]),
        CommTerm(term="cp_comm", seconds=terms_s["cp_comm"], group=cp, collective="CP exchange",
                 fabrics=[group_links(tp * cp, links)] if cp > 1 else [], bytes_per_collective=0.0,
                 per_layer_forward_s=per_layer_fwd["cp_comm"]),
        CommTerm(term="pp_p2p", seconds=terms_s["pp_p2p"], group=2 if pp > 1 else 1,
                 collective=f"PP send/receive ({PIPELINE_DTYPE} activations forward, gradients back)",
                 fabrics=[p2p_fabric] if pp > 1 else [], bytes_per_collective=p2p_bytes if pp > 1 else 0.0),
        CommTerm(term="dp_comm", seconds=dp_comm, group=dp * cp,
                 collective="DP reduce-scatter + all-gather (distributed optimizer)" if dist_opt
                 else "DP all-reduce", fabrics=[f for f, g in ((dp_fabric, dp * cp), (edp_fabric, edp_)) if g > 1],
                 bytes_per_collective=min(DDP_BUCKET_PARAMS, dense_p) * grad_b if dp * cp > 1 else 0.0),
    ]
    assumptions.append(
        f"communication: {links.intra.describe()} inside {links.domain} GPUs, {links.inter.describe()} across "
        "(muse_stack/machine/machines.yaml); megatron-core's 1F1B send/receive blocks and the all-to-all dispatcher "
        "runs in line" + ("" if overlap else
                          "; the DDP reduce runs after the last micro-batch (engine_options.overlap_grad_reduce "
                          "off)"))
    tokens_step = batch.gbs * seq
    tps = tokens_step / step / world
    flops = dict(training_flops_per_token(model, seq_lens, peft=settings))
    tower_flops = towers.flops_per_sequence() if towers is not None else None
    if tower_flops is not None:  # the towers' FLOPs of a sequence, per token of it
        flops["training"] += tower_flops["training"] / seq
        flops["training_6n"] += tower_flops["training_6n"] / seq
    peak = spec.peak_bf16_tflops * 1e12
    price = recipe.hardware.price_per_gpu_hour
    return StepTime(
        gpu=spec.name, step_s=step, tokens_per_step=tokens_step, tokens_per_s_per_gpu=tps,
        mfu=flops["training"] * tps / peak, mfu_6n=flops["training_6n"] * tps / peak,
        usd_per_million_tokens=price / (tps * 3600) * 1e6 if price else None,
        terms_s=terms_s, dominant=max(terms_s, key=lambda key: terms_s[key]), stage_s=stage_s,
        stage_gpu_s=stage_gpu, stage_host_s=stage_host, microbatches=microbatches, assumptions=assumptions, calibration=cal,
        kernels=kernels,
        communication=[c for c in comm if c.seconds > 0])
