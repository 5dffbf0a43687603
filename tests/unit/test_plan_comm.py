"""The step-time model's communication terms: each formula against a hand computation on a small
layout, which fabric a group crosses, every figure's citation, the B200 record's communication
reproduced from the cited figures, and properties (monotone in the message size, zero without a
group). CPU only; nothing is timed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muse_stack.machine.hardware import GPUS
from muse_stack.plan.cost import (
    PIPELINE_BYTES,
    alltoall_split,
    alltoall_time,
    estimate_step,
    p2p_time,
    ring_time,
    spec_links,
)
from muse_stack.machine.hardware import gpu_spec
from muse_stack.machine.table import table
from muse_stack.plan.fabrics import Fabric
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.resolve.recipe import finalize

# Each expected value below is a few float64 products and quotients of the same inputs taken in a
# different order: relative rounding <= ~10 x 2^-53 ~ 1e-15; 1e-12 leaves room for sums over
# micro-batches and layers and still fails on any wrong factor (the smallest one, 7/8, is 12%).
REL = 1e-12
B200 = GPUS["B200"]
P6 = spec_links(B200, 8)
FABRICS = table().fabrics
NVLINK4, NVLINK5, IB_NDR, EFA_P6_B200 = (FABRICS[k] for k in ("nvlink4", "nvlink5", "ib-ndr", "efa-p6-b200"))
EFA_P5EN = FABRICS["efa-p5en"]
# the cited numbers, restated: NVLink 5 at NVLink 4's measured 370 of 450 GB/s, EFA at its line rate
NVL5_GBPS = 900.0 * 370.0 / 450.0
EFA_GBPS, EFA_LATENCY_S = 50.0, 50.58e-6
UNTUNED = ["layout.tp=8", "layout.pp=8", "layout.first_stage_layers=7", "layout.last_stage_layers=7",
           "layout.ep=16", "layout.dp=2", "layout.label=null", "layout.summary=null", "layout.highlights=null"]


# ---- the figures ---------------------------------------------------------------------------

@pytest.mark.parametrize("fabric", list(FABRICS.values()), ids=lambda f: f.name)
def test_every_figure_names_its_source_and_basis(fabric: Fabric):
    for fig in (fabric.line_rate, fabric.bus, fabric.latency):
        if fig is None:
            continue
        assert fig.url and fig.quote and fig.basis in ("measured", "line rate", "derived")
    # what NCCL reaches never exceeds the wire
    assert 0 < fabric.bus.value <= fabric.line_rate.value


def test_the_cited_values():
    assert NVLINK4.gbps == 370.0 and NVLINK4.bus.basis == "measured"
    assert NVLINK5.gbps == pytest.approx(NVL5_GBPS, rel=REL) and NVLINK5.bus.basis == "derived"
    assert IB_NDR.gbps == 48.0 and IB_NDR.bus.basis == "measured"
    assert EFA_P6_B200.gbps == EFA_GBPS and EFA_P6_B200.bus.basis == "line rate"
    assert EFA_P6_B200.latency_s == pytest.approx(EFA_LATENCY_S, rel=REL)
    assert NVLINK5.latency_s == 0.0  # none published: bandwidth-bound sizes


# ---- fabric selection ----------------------------------------------------------------------

def test_fabric_selection_by_machine():
    # one scale-out fabric per machine: the one its launch target sets up (H100 is planned, not launched)
    assert (P6.intra, P6.inter, P6.domain) == (NVLINK5, EFA_P6_B200, 8)
    h200 = spec_links(GPUS["H200"], 8)
    assert (h200.intra, h200.inter, h200.domain) == (NVLINK4, EFA_P5EN, 8)
    assert (spec_links(GPUS["H100"], 8).intra, spec_links(GPUS["H100"], 8).inter) == (NVLINK4, IB_NDR)
    # GB200: the NVL72 domain spans trays of 4
    gb200 = spec_links(GPUS["GB200"], 4)
    assert gb200.domain == 72 and gb200.intra == FABRICS["nvlink5-nvl72"] and gb200.inter == FABRICS["efa-p6e-gb200"]
    assert gpu_spec("Z100") is None


def test_a_group_crosses_nodes_only_beyond_the_nvlink_domain():
    assert P6.crossing(2) is NVLINK5 and P6.crossing(8) is NVLINK5
    assert P6.crossing(9) is EFA_P6_B200 and P6.crossing(16) is EFA_P6_B200


def test_alltoall_peers_inside_and_outside_the_node():
    assert alltoall_split(8, 8, 8) == (7, 0)  # EP 8 on one node
    assert alltoall_split(16, 16, 8) == (7, 8)  # EP 16 over two nodes
    assert alltoall_split(8, 16, 8) == (3, 4)  # EP 8 with ETP 2: every other rank, 4 per node
    assert alltoall_split(1, 1, 8) == (0, 0)
    # GB200 trays hold 4 GPUs but the NVL72 domain joins 72: all 15 peers of EP 16 are on NVLink
    assert alltoall_split(16, 16, spec_links(GPUS["GB200"], 4).domain) == (15, 0)


# ---- each formula by hand ------------------------------------------------------------------

def test_ring_by_hand():
    # 4 ranks, 3 GB tensor: each moves 3/4 of it, after the fixed time
    assert ring_time(3e9, 4, 740.0, 50e-6) == pytest.approx(50e-6 + 2.25e9 / 740e9, rel=REL)
    assert ring_time(3e9, 1, 740.0, 50e-6) == 0.0


def test_alltoall_by_hand():
    # EP 8 inside a p6-b200 node: 7 of 8 equal shares over NVLink 5, no fixed time published
    assert alltoall_time(8e9, 8, 8, P6) == pytest.approx(7e9 / (NVL5_GBPS * 1e9), rel=REL)
    # EP 16 over two nodes: 7 shares on NVLink (9.5 ms) against 8 over the one EFA NIC (160 ms)
    assert alltoall_time(16e9, 16, 16, P6) == pytest.approx(EFA_LATENCY_S + 8e9 / (EFA_GBPS * 1e9), rel=REL)
    # on p5en the GPU's 50 GB/s is two 200 Gb/s NICs: the all-to-all gets one of them (320 ms)
    h200 = spec_links(GPUS["H200"], 8)
    assert EFA_P5EN.nics_per_gpu == 2 and EFA_P5EN.gbps == EFA_GBPS
    assert alltoall_time(16e9, 16, 16, h200) == pytest.approx(EFA_LATENCY_S + 8e9 / (EFA_GBPS / 2 * 1e9), rel=REL)


def test_p2p_by_hand():
    assert p2p_time(1e9, EFA_P6_B200) == pytest.approx(EFA_LATENCY_S + 1e9 / (EFA_GBPS * 1e9), rel=REL)
    assert p2p_time(1e9, NVLINK5) == pytest.approx(1e9 / (NVL5_GBPS * 1e9), rel=REL)


def _steps(overrides: list[str], params: list[tuple[int, int]] | None = None):
    recipe = load_recipe("attune-b200", overrides)
    plan, _ = make_plan(recipe, strict=False)
    assert plan.time is not None, plan.time_unavailable
    if params is None:
        return plan.time
    return estimate_step(finalize(recipe), B200, plan.world_size, plan.stages, plan.dp,
                         plan.expert_dp, plan.microbatches_per_replica, params)


def test_record_layout_terms_from_the_cited_figures():
    """TP 2, PP 16, EP 8, DP 4 on 16 p6-b200 nodes, one 8,192-token micro-batch, 32 per step;
    the slowest stage holds 4 layers. Hidden 8192, latent 4096, top-8, fp32 pipeline."""
    t = _steps([])
    m, layers, tokens, h = 32, 4, 8192, 8192
    # TP 2 with SP, inside the node: 4 rings a layer forward of the bf16 t x H, 1.5x that backward
    tp_fwd = 4 * (1 / 2) * 2 * tokens * h / (NVL5_GBPS * 1e9)
    assert t.terms_s["tp_comm"] == pytest.approx(m * layers * 2.5 * tp_fwd, rel=REL)
    # EP 8 = one node: dispatch + combine of top-8 x t/TP slots at width 4096, 7/8 of it leaves the GPU
    ep_fwd = 2 * (7 / 8) * 2 * 8 * (tokens // 2) * 4096 / (NVL5_GBPS * 1e9)
    assert t.terms_s["ep_alltoall"] == pytest.approx(m * layers * 2 * ep_fwd, rel=REL)
    # PP: each stage is one node, so the boundary is EFA; fp32 t/TP x H forward and back
    p2p = EFA_LATENCY_S + PIPELINE_BYTES * (tokens // 2) * h / (EFA_GBPS * 1e9)
    assert t.terms_s["pp_p2p"] == pytest.approx(m * 2 * p2p, rel=REL)
    names = {c.term: [f.name for f in c.fabrics] for c in t.communication}
    assert names["ep_alltoall"] == [NVLINK5.name] and names["pp_p2p"] == [EFA_P6_B200.name]


def test_untuned_layout_sends_half_the_all_to_all_over_efa():
    """TP 8, PP 8, EP 16 (two nodes a stage), 64 micro-batches, 8 layers on the slowest stage."""
    t = _steps(UNTUNED)
    m, layers, tokens = 64, 8, 8192
    per_peer = 2 * 8 * (tokens // 8) * 4096 / 16
    one = EFA_LATENCY_S + max(7 * per_peer / (NVL5_GBPS * 1e9), 8 * per_peer / (EFA_GBPS * 1e9))
    assert t.terms_s["ep_alltoall"] == pytest.approx(m * layers * 2 * 2 * one, rel=REL)
    ep = next(c for c in t.communication if c.term == "ep_alltoall")
    assert [f.name for f in ep.fabrics] == [NVLINK5.name, EFA_P6_B200.name]


def test_dp_terms_by_hand():
    # 80 M dense parameters a GPU: two 40 M buckets, each a fp32 reduce-scatter and a bf16 all-gather
    params = 80_000_000
    tuned = _steps([], [(params, 0)] * 16)  # DP 4 over the 8 ranks of a node: NVLink
    assert tuned.terms_s["dp_comm"] == pytest.approx(0.75 * params * 6 / (NVL5_GBPS * 1e9), rel=REL)
    untuned = _steps(UNTUNED, [(params, 0)] * 8)  # DP 2, ranks 8 apart: across nodes, EFA
    assert untuned.terms_s["dp_comm"] == pytest.approx(2 * 2 * EFA_LATENCY_S + 0.5 * params * 6 / (EFA_GBPS * 1e9),
                                                       rel=REL)


def test_plan_prints_a_communication_line_per_term(cli):
    rc, out, _ = cli("plan", "attune-b200")
    assert rc == 0
    for term in ("tp comm", "ep alltoall", "pp p2p", "dp comm"):
        assert f"communication: {term} " in out, term
    assert "EFAv4 (p6-b200.48xlarge" in out and "740 GB/s (derived)" in out


# ---- properties ----------------------------------------------------------------------------

sizes = st.floats(min_value=0.0, max_value=1e12, allow_nan=False)
groups = st.integers(min_value=2, max_value=64)


@given(a=sizes, b=sizes, group=groups)
def test_monotone_in_message_size(a, b, group):
    lo, hi = sorted((a, b))
    span = group * 2
    assert ring_time(lo, group, 740.0, 1e-5) <= ring_time(hi, group, 740.0, 1e-5)
    assert alltoall_time(lo, group, span, P6) <= alltoall_time(hi, group, span, P6)
    assert p2p_time(lo, EFA_P6_B200) <= p2p_time(hi, EFA_P6_B200)


@given(size=sizes, span=st.integers(min_value=1, max_value=64))
def test_zero_without_a_group(size, span):
    assert ring_time(size, 1, 740.0, 1e-5) == 0.0
    assert alltoall_time(size, 1, span, P6) == 0.0
    assert p2p_time(0.0, EFA_P6_B200) == 0.0


def test_overlapped_grad_reduce_leaves_the_last_bucket_and_the_gather_exposed():
    """engine_options.overlap_grad_reduce: the reduce-scatter runs under the last micro-batch's backward
    (a stage's backward here is tens of milliseconds against ~0.2 ms a bucket) but for its last
    bucket; the bf16 all-gather after the optimizer stays whole."""
    params = 80_000_000  # two 40 M buckets
    plain = _steps([], [(params, 0)] * 16)
    over = _steps(["engine_options.overlap_grad_reduce=true"], [(params, 0)] * 16)
    reduce = 0.75 * params * 4 / (NVL5_GBPS * 1e9)
    gather = 0.75 * params * 2 / (NVL5_GBPS * 1e9)
    assert plain.terms_s["dp_comm"] == pytest.approx(reduce + gather, rel=REL)
    assert over.terms_s["dp_comm"] == pytest.approx(reduce / 2 + gather, rel=REL)
    assert any("overlap_grad_reduce" in a for a in over.assumptions)
    assert not any("overlap_grad_reduce:" in a for a in plain.assumptions)
