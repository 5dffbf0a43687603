"""The published MoE runs the planner is checked on at scale (muse_stack/plan/published/bridge-moe.yaml), the
public models' shapes and the at-scale step-time terms (muse_stack/plan/scale.py)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from muse_stack.plan.published import FILE, load, parse
from muse_stack.plan.scale import BF16, LOGITS_BYTES, ScaleCalibration, estimate, split_layers
from muse_stack.util.errors import InputError


@pytest.fixture(scope="module")
def pub():
    return load()


def _text_with(change) -> str:
    data = yaml.safe_load(FILE.read_text(encoding="utf-8"))
    change(data)
    return yaml.safe_dump(data)


# ---- the data file and its protocol ---------------------------------------------------------------------------------


def test_the_data_file_parses_with_every_model_and_system(pub):
    assert {r.model for r in pub.rows} == {"deepseek-v3", "gpt-oss-120b", "qwen3-30b-a3b", "qwen3-235b-a22b"}
    assert {r.system for r in pub.rows} == {"DGX-GB300", "DGX-GB200", "DGX-B200", "DGX-H100"}
    assert {r.precision for r in pub.rows} == {"bf16", "fp8-cs", "fp8-mx"}
    assert pub.source.commit == "5776a6d90b4dd8692902ab2eb581369484e19283"


def test_the_protocol_holds(pub):
    fit = [r for r in pub.rows if pub.role(r.id) == "fit"]
    assert 3 * len(fit) <= len(pub.rows)
    fit_pairs = {(r.model, r.system) for r in fit}
    validation = [r for r in pub.rows if pub.role(r.id) == "validation"]
    assert not [r.id for r in validation if (r.model, r.system) in fit_pairs]
    # the goal asks validation rows on these generations
    machines = {pub.systems[r.system].machine for r in validation}
    assert set(pub.protocol.goal.validation_generations) <= machines


def test_too_many_fit_rows_are_refused():
    def more(data):
        data["protocol"]["fit_rows"] += [r["id"] for r in data["rows"] if r["system"] == "DGX-GB200"]

    with pytest.raises(InputError, match="at most a third"):
        parse(_text_with(more))


def test_a_fit_row_beside_a_validation_row_of_its_model_and_system_is_refused():
    def overlap(data):
        data["protocol"]["fit_rows"] = ["gb200-deepseek-v3-bf16"]

    with pytest.raises(InputError, match="model and system of a fit row"):
        parse(_text_with(overlap))


def test_a_layout_that_does_not_split_is_refused_with_its_field():
    def bad(data):
        data["rows"][0]["gbs"] = 4095

    with pytest.raises(InputError, match="GBS must be a multiple"):
        parse(_text_with(bad))


def test_an_unknown_row_names_the_known_ones(pub):
    with pytest.raises(InputError, match="gb200-deepseek-v3-bf16"):
        pub.row("no-such-run")


# ---- each run's settings, as Megatron-Bridge's source states them ---------------------------------------------------

R = "7af9601c9"  # Megatron-Bridge v0.2.0, the release behind the 25.11 table


def test_a_corrected_layout_keeps_the_page_and_prices_the_run_with_its_citation(pub):
    row, run = pub.row("b200-gpt-oss-120b-bf16"), pub.run("b200-gpt-oss-120b-bf16")
    assert (row.ep, run.ep) == (8, 64)  # the page prints EP 8; every preset of the run says 64
    fix = pub.corrections(row.id)
    assert set(fix) == {"ep"} and fix["ep"]["page"] == 8 and fix["ep"]["run"] == 64
    assert fix["ep"]["source"] == f"{R} scripts/performance/configs/gpt_oss/workload_base_configs.py:50-55"
    assert pub.settings_sources[R].commit == "7af9601c9da746d21481194356295bfe23df3737"
    assert pub.settings_sources[R].repo == "NVIDIA-NeMo/Megatron-Bridge"
    # the planner prices the run: 64 ranks over eight 8-GPU nodes, 7 peers inside the node, 56 across
    step = estimate(pub, run, cal=CAL)
    assert any("over 64 ranks: 7 peers over NVLink 5" in a and "56 over InfiniBand" in a for a in step.assumptions)
    page = estimate(pub, run.model_copy(update={"ep": 8}), cal=CAL)
    assert step.terms_s["ep_alltoall"] > 3 * page.terms_s["ep_alltoall"]


def test_a_row_the_page_prints_whole_has_no_correction(pub):
    assert pub.corrections("h100-qwen3-235b-a22b-fp8-cs") == {}
    run, row = pub.run("h100-qwen3-235b-a22b-fp8-cs"), pub.row("h100-qwen3-235b-a22b-fp8-cs")
    assert (run.tp, run.pp, run.vp, run.ep, run.mbs) == (row.tp, row.pp, row.vp, row.ep, row.mbs)


def test_the_run_runs_the_micro_batches_megatron_core_derives(pub):
    for r in pub.rows:
        run = pub.run(r.id)
        ga = pub.run_settings[r.id].ga
        assert run.microbatches == (ga.value if ga else r.ga), r.id
    # the H100 Qwen3-30B-A3B row as it ran: MBS 1, VP 12, so 64 micro-batches (the page: MBS 2, VP 24, GA 32)
    run = pub.run("h100-qwen3-30b-a3b-fp8-cs")
    assert (run.mbs, run.vp, run.microbatches) == (1, 12, 64)


def test_gpt_oss_recompute_was_inert_and_is_not_priced(pub):
    for r in (r for r in pub.rows if r.model == "gpt-oss-120b"):
        assert pub.run(r.id).recompute == [], r.id
        step = estimate(pub, pub.run(r.id), cal=CAL)
        assert step.terms_s["recompute"] == 0.0, r.id
    cited = pub.run_settings["b200-gpt-oss-120b-bf16"].recompute.source
    assert f"{R} scripts/performance/utils/helpers.py:178-179" in cited


def test_the_unpriced_settings_are_stated_per_run(pub):
    a2a = estimate(pub, pub.run("b200-qwen3-235b-a22b-fp8-mx"), cal=CAL).assumptions
    assert any(a.startswith("A2A overlap: on in the run") and "not priced" in a for a in a2a)
    assert any(a.startswith("dispatcher: alltoall") for a in a2a)
    assert any(a.startswith("CUDA graphs: none in the run") for a in a2a)
    assert any(a.startswith("host time of a MoE layer without CUDA graphs, 16 local experts, FP8") for a in a2a)
    hybrid = estimate(pub, pub.run("gb200-qwen3-30b-a3b-fp8-mx"), cal=CAL).assumptions
    assert any(a.startswith("dispatcher: hybridep") for a in hybrid)
    assert any(a.startswith("CUDA graphs: the run graphs moe_router, moe_preprocess") for a in hybrid)
    assert any(a.startswith("host time of a MoE layer's forward") and "fitted" in a for a in hybrid)
    assert any(a.startswith("A2A overlap: off in the run") for a in hybrid)


def test_dense_mlp_recompute_prices_the_leading_dense_layers(pub):
    run = pub.run("gb300-deepseek-v3-bf16")
    assert run.recompute == ["mlp", "moe_act"] and run.vp == 8
    with_ = estimate(pub, run, cal=CAL)
    without = estimate(pub, run.model_copy(update={"recompute": ["moe_act"]}), cal=CAL)
    # the three dense layers sit on the first stage: its work grows, its kept activations shrink
    assert with_.stage_work_s[0] > without.stage_work_s[0]
    assert with_.stage_work_s[1:] == without.stage_work_s[1:]
    assert with_.memory_parts_gib["activations"] < without.memory_parts_gib["activations"]


def test_the_protocol_states_its_amendments(pub):
    settings, logits, host = pub.protocol.amendments
    for amendment in (settings, logits):
        assert amendment.after_errors_seen is True
        assert set(amendment.refitted) == {f.name for f in pub.protocol.fitted}
    assert "cross-entropy" in logits.change
    # the measured host time: no fit row runs ungraphed, so nothing was refitted, and the result before is kept
    assert host.after_errors_seen is True and host.refitted == []
    assert all(pub.run(r).cuda_graphs for r in pub.protocol.fit_rows)
    assert host.result_before == "benchmarks/results/archive/bridge-moe-validation-forward-host-gap"
    # the roles are as declared: every GB300 row fits, nothing else
    assert set(pub.protocol.fit_rows) == {r.id for r in pub.rows if r.system == "DGX-GB300"}


def _settings(data, row="b200-gpt-oss-120b-bf16"):
    return data["run_settings"][row]


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: _settings(d).update(dispatch={"value": "alltoall", "source": f"{R} a.py:1"}),
     "run_settings.b200-gpt-oss-120b-bf16.dispatch"),
    (lambda d: _settings(d)["ep"].update(reason="preset"), "run_settings.b200-gpt-oss-120b-bf16.ep.reason"),
    (lambda d: _settings(d)["dispatcher"].update(value="nccl"), "run_settings.b200-gpt-oss-120b-bf16.dispatcher.value"),
    (lambda d: _settings(d)["cuda_graphs"].update(value=["everything"]),
     "run_settings.b200-gpt-oss-120b-bf16.cuda_graphs.value.0"),
    (lambda d: _settings(d)["ep"].update(source="the preset"), "run_settings.b200-gpt-oss-120b-bf16.ep.source"),
    (lambda d: _settings(d)["ep"].update(source=f"{R} scripts/performance/configs/gpt_oss/workload_base_configs.py"),
     "run_settings.b200-gpt-oss-120b-bf16.ep.source"),
    (lambda d: _settings(d).pop("a2a_overlap"), "run_settings.b200-gpt-oss-120b-bf16.a2a_overlap"),
    (lambda d: _settings(d).pop("cross_entropy"), "run_settings.b200-gpt-oss-120b-bf16.cross_entropy"),
    (lambda d: _settings(d)["cross_entropy"].update(value="native"),
     "run_settings.b200-gpt-oss-120b-bf16.cross_entropy.value"),
])
def test_a_malformed_run_settings_block_is_refused_naming_the_field(change, field):
    with pytest.raises(InputError) as e:
        parse(_text_with(change))
    assert e.value.field == field


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d["run_settings"].pop("b200-gpt-oss-120b-bf16"),
     "run_settings.b200-gpt-oss-120b-bf16: every row states its run settings"),
    (lambda d: d["run_settings"].update({"no-such-run": d["run_settings"]["b200-gpt-oss-120b-bf16"]}),
     "run_settings.no-such-run: no row has this id"),
    (lambda d: _settings(d)["ep"].update(source="0123456789 a.py:1"), "run_settings.b200-gpt-oss-120b-bf16.ep.source"),
    (lambda d: _settings(d)["ep"].update(source="abcdef012 a.py:1"),
     "run_settings.b200-gpt-oss-120b-bf16.ep.source: commit abcdef012 is not in settings_sources"),
    (lambda d: _settings(d)["ep"].update(value=48), "the run's layout does not split"),
    (lambda d: _settings(d)["cross_entropy"].update(source="123456789 a.py:1"),
     "run_settings.b200-gpt-oss-120b-bf16.cross_entropy.source: commit 123456789 is not in settings_sources"),
    (lambda d: _settings(d, "h100-gpt-oss-120b-bf16")["ga"].update(value=8),
     "run_settings.h100-gpt-oss-120b-bf16.ga: 8 is not GBS / (MBS x DP) = 512 / (1 x 16)"),
    (lambda d: _settings(d, "h100-gpt-oss-120b-bf16").pop("ga"),
     "rows.h100-gpt-oss-120b-bf16.ga: 2 is not GBS / (MBS x DP)"),
    (lambda d: d["protocol"]["amendments"][0].update(refitted=["scale.no_such_constant"]),
     "amendments.0.refitted: scale.no_such_constant is not a fitted constant"),
])
def test_run_settings_that_break_the_files_rules_are_refused(change, words):
    with pytest.raises(InputError, match=re.escape(words)):
        parse(_text_with(change))


# ---- the models' shapes ---------------------------------------------------------------------------------------------


def test_shapes_reproduce_the_models_published_sizes(pub):
    m = pub.models
    # total and active parameters as the model cards state them (billions, as rounded there)
    assert round(m["deepseek-v3"].total_params() / 1e9) == 671
    assert round(m["qwen3-235b-a22b"].total_params() / 1e9) == 235
    assert round(m["qwen3-30b-a3b"].total_params() / 1e9, 1) == 30.5
    assert round(m["gpt-oss-120b"].total_params() / 1e9, 1) == 116.8
    assert round(m["gpt-oss-120b"].active_params() / 1e9, 1) == 5.1


@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_flops_per_token_match_the_page(pub, model):
    """The page's Model TFLOP/s over its tokens/s is its FLOPs per token. Ours agree within 1%: the page rounds
    TFLOP/s to an integer (up to 0.4% at 121) and its formula differs from the causal count in small terms (the
    (s+1)/2 against s/2 mean keys, the router); MTP's layer and output GEMM on the row that trains it."""
    for r in (r for r in pub.rows if r.model == model):
        page = r.published_tflops * 1e12 / r.published_tokens_per_s_per_gpu
        ours = pub.models[model].training_flops_per_token(r.seq, r.mtp)
        assert ours == pytest.approx(page, rel=0.01), r.id


def test_mla_and_gqa_shapes(pub):
    ds = pub.models["deepseek-v3"]
    # MLA: query latent, query up (128 heads x (128 + 64)), key-value latent with the RoPE key, key-value up, output
    assert [(k, n) for k, n, _ in ds.attention_gemms()] == [
        (7168, 1536), (1536, 128 * 192), (7168, 512 + 64), (512, 128 * (128 + 128)), (128 * 128, 7168)]
    assert ds.is_moe(2) is False and ds.is_moe(3) is True  # three leading dense layers
    q = pub.models["qwen3-30b-a3b"]
    assert [(k, n) for k, n, _ in q.attention_gemms()] == [(2048, 32 * 128 + 2 * 4 * 128), (32 * 128, 2048)]
    g = pub.models["gpt-oss-120b"]
    assert g.is_sliding(0) and not g.is_sliding(1)
    # a sliding layer's mean keys at 4,096 tokens: 128 but for the first 128 positions
    assert g.mean_keys(0, 4096) == pytest.approx((128 * 129 / 2 + (4096 - 128) * 128) / 4096)
    assert g.mean_keys(1, 4096) == pytest.approx(4097 / 2)


def test_split_layers_as_bridges_layout_map():
    assert split_layers(61, 16) == [4] * 15 + [1]
    assert split_layers(61, 8) == [8] * 7 + [5]
    assert split_layers(61, 32) == [2] * 29 + [1] * 3  # ceil leaves the last empty: as even as possible
    assert split_layers(94, 48) == [2] * 46 + [1] * 2
    assert split_layers(48, 1) == [48]


# ---- the at-scale terms ---------------------------------------------------------------------------------------------

#: no host time at all: the other terms alone
NO_HOST = {f"ungraphed_host_{ph}_{p}{per}_s": 0.0 for ph in ("fwd", "bwd") for p in ("bf16", "fp8")
           for per in ("", "_per_expert")}
CAL = ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.0, **NO_HOST)


def test_fp8_runs_its_gemms_at_the_fp8_peak(pub):
    row = pub.run("gb200-qwen3-30b-a3b-fp8-mx")  # one stage: the same layers in both
    fp8 = estimate(pub, row, cal=CAL)
    bf16 = estimate(pub, row.model_copy(update={"precision": "bf16"}), cal=CAL)
    # compute-bound GEMMs (8,192 slots an expert): the FP8 peak is twice BF16's on GB200, so the GEMM terms fall by close to half
    assert 0.45 < fp8.terms_s["expert_gemm"] / bf16.terms_s["expert_gemm"] < 0.6
    assert fp8.terms_s["fp8_cast"] > 0 and bf16.terms_s["fp8_cast"] == 0
    assert fp8.terms_s["attention"] == pytest.approx(bf16.terms_s["attention"])  # the core stays in bf16


def test_interleaving_shrinks_the_bubble(pub):
    row = pub.run("h100-qwen3-30b-a3b-fp8-cs").model_copy(update={"vp": 24})  # PP 2, VP 24 (the page's VP)
    inter = estimate(pub, row, cal=CAL)
    plain = estimate(pub, row.model_copy(update={"vp": 1}), cal=CAL)
    # (PP - 1) x mean stage work / VP
    for step, vp in ((inter, 24), (plain, 1)):
        mean = sum(step.stage_work_s) / len(step.stage_work_s)
        assert step.terms_s["pp_bubble"] == pytest.approx((2 - 1) * mean / vp)
    assert inter.terms_s["pp_bubble"] < plain.terms_s["pp_bubble"] / 20
    assert inter.terms_s["pp_p2p"] > plain.terms_s["pp_p2p"]  # but a send per virtual stage


def test_uneven_last_stage_costs_the_slowest_stage(pub):
    row = pub.run("b200-deepseek-v3-fp8-mx")  # PP 16: 15 stages of 4 layers and one of 1 with the output layer
    step = estimate(pub, row, cal=CAL)
    assert step.chunk_layers == [4] * 15 + [1]
    # the middle stages (four MoE layers each) are the slowest; the first holds three dense layers, the last one
    # layer, MTP's and the output layers
    slow = max(step.stage_work_s)
    assert all(w == pytest.approx(slow) for w in step.stage_work_s[1:-1])
    assert step.stage_work_s[0] < slow and step.stage_work_s[-1] < slow
    # the steady state runs at the slowest stage: its terms, per micro-batch, sum to its work
    per_mb = sum(v for k, v in step.terms_s.items() if k not in ("pp_bubble", "dp_comm", "optimizer"))
    assert per_mb / step.microbatches == pytest.approx(slow)


def test_expert_alltoall_crosses_the_network_only_outside_the_nvlink_domain(pub):
    h100 = estimate(pub, pub.run("h100-qwen3-235b-a22b-fp8-cs"), cal=CAL)  # EP 32 over 8-GPU nodes
    assert any("7 peers over NVLink 4" in a and "24 over InfiniBand" in a for a in h100.assumptions)
    gb200 = estimate(pub, pub.run("gb200-qwen3-235b-a22b-bf16"), cal=CAL)  # EP 32 inside a 72-GPU domain
    assert any("31 peers over NVLink 5" in a and ", 0 over" in a for a in gb200.assumptions)
    # the same all-to-all bytes per GPU cost far more across InfiniBand
    assert h100.terms_s["ep_alltoall"] > 3 * gb200.terms_s["ep_alltoall"]


def test_host_time_of_a_moe_layer_bounds_a_small_layers_forward(pub):
    row = pub.run("b200-qwen3-30b-a3b-fp8-mx")
    free = estimate(pub, row, cal=CAL)
    slow = estimate(pub, row, cal=ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.05))
    assert free.terms_s["host_sync"] == 0.0
    # 48 MoE layers x 64 micro-batches, each forward at least 50 ms: the host term is nearly all of it
    assert slow.terms_s["host_sync"] == pytest.approx(48 * 64 * 0.05, rel=0.1)
    assert slow.terms_s["host_sync"] < 48 * 64 * 0.05
    # a large layer hides the same host time
    big = estimate(pub, pub.run("gb200-deepseek-v3-bf16"),
                   cal=ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=1e-3))
    assert big.terms_s["host_sync"] == 0.0


def test_an_ungraphed_run_waits_for_the_measured_host_in_both_passes(pub):
    row = pub.run("h100-qwen3-30b-a3b-fp8-cs")  # no CUDA graphs; PP 2 x VP 12: 24 MoE layers a stage, 64 micro-batches
    assert row.cuda_graphs == []
    free = estimate(pub, row, cal=CAL)
    assert free.terms_s["host_sync"] == 0.0
    for phase in ("fwd", "bwd"):  # 50 ms of host in one pass: each layer's pass at least that long
        cal = ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.0,
                               **NO_HOST | {f"ungraphed_host_{phase}_fp8_s": 0.05})
        slow = estimate(pub, row, cal=cal)
        assert 0.9 * 24 * 64 * 0.05 < slow.terms_s["host_sync"] < 24 * 64 * 0.05, phase
        # bf16's figure is not this FP8 run's
        other = ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.0,
                                 **NO_HOST | {f"ungraphed_host_{phase}_bf16_s": 0.05})
        assert estimate(pub, row, cal=other).terms_s["host_sync"] == 0.0
    # the fitted graphed figure does not touch an ungraphed run
    assert estimate(pub, row, cal=ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.05, **NO_HOST)
                    ).terms_s["host_sync"] == 0.0


def test_a_graphed_run_keeps_the_fitted_forward_figure(pub):
    row = pub.run("b200-qwen3-30b-a3b-fp8-mx")  # graphs its router and preprocessing
    assert row.cuda_graphs
    measured = ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.0,
                                **NO_HOST | {"ungraphed_host_bwd_fp8_s": 0.05, "ungraphed_host_fwd_fp8_s": 0.05})
    assert estimate(pub, row, cal=measured).terms_s["host_sync"] == 0.0


def test_the_host_time_grows_with_the_local_experts(pub):
    row = pub.run("h100-qwen3-30b-a3b-fp8-cs")  # 128 experts
    cal = ScaleCalibration(gemm_efficiency_sm100=0.5, moe_sync_gap_s=0.0,
                           **NO_HOST | {"ungraphed_host_bwd_fp8_per_expert_s": 2e-3})
    at_ep8 = estimate(pub, row, cal=cal)  # 16 local experts: 32 ms a backward
    at_ep4 = estimate(pub, row.model_copy(update={"ep": 4}), cal=cal)  # 32: 64 ms
    assert at_ep4.terms_s["host_sync"] > 1.5 * at_ep8.terms_s["host_sync"] > 0
    assert any("16 local experts" in a and "0.00 ms forward and 32.00 ms backward" in a for a in at_ep8.assumptions)


def test_dp_gather_is_exposed_where_the_preset_turns_its_overlap_off(pub):
    row = pub.run("gb200-deepseek-v3-fp8-mx")
    assert row.overlap_param_gather is False
    off = estimate(pub, row, cal=CAL)
    on = estimate(pub, row.model_copy(update={"overlap_param_gather": True}), cal=CAL)
    assert off.terms_s["dp_comm"] > on.terms_s["dp_comm"]


def test_terms_sum_to_the_step_and_assumptions_name_what_is_not_expressed(pub):
    for r in pub.rows:
        step = estimate(pub, pub.run(r.id), cal=CAL)
        assert sum(step.terms_s.values()) == pytest.approx(step.step_s, rel=1e-9), r.id
        assert any("dispatcher" in a for a in step.assumptions)
    mtp = estimate(pub, pub.run("b200-deepseek-v3-fp8-mx"), cal=CAL)
    assert any(a.startswith("MTP") for a in mtp.assumptions)
    sinks = estimate(pub, pub.run("gb200-gpt-oss-120b-bf16"), cal=CAL)
    assert any("sinks" in a for a in sinks.assumptions)


def test_the_logits_memory_is_the_runs_cross_entropys(pub):
    """Every run's loss is TransformerEngine's fused cross-entropy (its source cited at the release and at the
    kernel, which writes the gradient into the bf16 logits in place): the logits cost bf16 alone, where an unfused
    loss keeps bf16 and two fp32 copies. Priced on the one-stage row that holds them, to the byte."""
    te = "70f536662"
    assert pub.settings_sources[te].repo == "NVIDIA/TransformerEngine"
    assert pub.settings_sources[te].commit == "70f536662ae10a62a54f4ed1ba92e3314c5cfd69"
    for r in pub.rows:
        ce = pub.run_settings[r.id].cross_entropy
        assert pub.run(r.id).cross_entropy == ce.value == "te-fused", r.id
        assert "scripts/performance/utils/helpers.py:108,285" in ce.source, r.id
        assert f"{te} transformer_engine/pytorch/triton/cross_entropy.py:172-187,342" in ce.source, r.id
    assert LOGITS_BYTES == {"te-fused": BF16, "unfused": BF16 + 4 + 4}
    run = pub.run("gb300-qwen3-30b-a3b-fp8-mx")  # PP 1: stage 0 holds the output layer; MBS 8 x 4,096 tokens
    vocab = pub.models[run.model].vocab_size
    fused = estimate(pub, run, cal=CAL)
    unfused = estimate(pub, run.model_copy(update={"cross_entropy": "unfused"}), cal=CAL)
    assert fused.memory_parts_gib["logits"] == 2 * 8 * 4096 * vocab / 2 ** 30
    assert unfused.memory_parts_gib["logits"] == 5 * fused.memory_parts_gib["logits"]
    assert unfused.memory_gib - fused.memory_gib == pytest.approx(8 * 8 * 4096 * vocab / 2 ** 30, rel=1e-12)
    assert any(a.startswith("cross-entropy: te-fused") and "in place" in a for a in fused.assumptions)
    # the row fits with the run's loss, and would not with an unfused one
    assert fused.fits and not unfused.fits
    # a pipelined row's logits are its last stage's: not in stage 0's memory either way
    deep = pub.run("gb200-deepseek-v3-bf16")
    assert estimate(pub, deep, cal=CAL).memory_parts_gib["logits"] == 0.0
    assert estimate(pub, deep.model_copy(update={"cross_entropy": "unfused"}), cal=CAL).memory_gib == \
        estimate(pub, deep, cal=CAL).memory_gib


def test_every_published_layout_is_predicted_to_fit(pub):
    for r in pub.rows:
        step = estimate(pub, pub.run(r.id))
        assert step.fits, (r.id, step.memory_gib, step.capacity_gib)


def test_recompute_prices_the_mla_up_projections_again(pub):
    row = pub.run("gb200-deepseek-v3-bf16")
    assert row.recompute == ["mla_up_proj"]
    with_ = estimate(pub, row, cal=CAL)
    without = estimate(pub, row.model_copy(update={"recompute": []}), cal=CAL)
    assert with_.terms_s["recompute"] > 0 == without.terms_s["recompute"]
    assert with_.memory_parts_gib["activations"] < without.memory_parts_gib["activations"]


# ---- the CLI --------------------------------------------------------------------------------------------------------


def test_plan_published_prints_its_prediction(cli):
    rc, out, _ = cli("plan", "gb200-deepseek-v3-bf16", "--published", "--json")
    assert rc == 0
    step = json.loads(out)
    assert step["row"] == "gb200-deepseek-v3-bf16" and step["gpu"] == "GB200"
    assert step["tokens_per_s_per_gpu"] > 0 and "host_sync" in step["terms_s"]


def test_plan_published_prices_the_run_and_shows_where_the_page_differs(cli):
    rc, out, _ = cli("plan", "b200-gpt-oss-120b-bf16", "--published", "--json")
    assert rc == 0
    step = json.loads(out)
    assert step["page_differs"]["ep"]["page"] == 8 and step["page_differs"]["ep"]["run"] == 64
    rc, out, _ = cli("plan", "b200-gpt-oss-120b-bf16", "--published")
    assert rc == 0 and "EP 64 in the run, 8 on the page" in out and "dispatcher alltoall" in out


def test_plan_published_refuses_an_unknown_row(cli):
    rc, _, err = cli("plan", "no-such-run", "--published")
    assert rc != 0 and "gb200-deepseek-v3-bf16" in err


def test_tune_published_ranks_the_published_layout(cli):
    rc, out, _ = cli("tune", "gb200-qwen3-30b-a3b-fp8-mx", "--published", "--json", "--top", "3")
    assert rc == 0
    found = json.loads(out)
    assert 1 <= found["published_rank"] <= found["layouts"]
    speeds = [c["tokens_per_s_per_gpu"] for c in found["best"]]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 3


def test_the_file_is_package_data():
    """The product reads the file at run time: an installed package must carry it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["muse_stack"]
    assert FILE.relative_to(root / "muse_stack").as_posix() in data
