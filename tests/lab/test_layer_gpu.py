"""benchmarks/scripts/plan/layer_gpu.py: the planner's GPU time of host_sync_probe.py's decoder layer, set beside the
committed probes (benchmarks/results/host-sync-probe/)."""

import json

import pytest

from bench_results import RESULTS, script

layer_gpu = script("plan/layer_gpu")
PROBE = RESULTS / "host-sync-probe"


def test_each_probed_count_is_priced_and_marked_gpu_bound_by_its_wall_time_against_the_host_floor():
    record = json.loads((PROBE / "host_sync_layer.json").read_text())
    rows = layer_gpu.compare(record, "H100")
    (probe,) = record["probes"]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in probe["rows"]]
    floor = probe["host_fwd_s"] + probe["host_bwd_s"]
    for row, measured in zip(rows, probe["rows"], strict=True):
        assert row["measured_s"] == measured["fwd_bwd_event_s"] and row["planned_s"] > 0
        assert row["gpu_bound"] == (measured["fwd_bwd_wall_s"] >= 2 * floor)
    planned = [r["planned_s"] for r in rows]
    assert planned == sorted(planned)  # more tokens, more work


def test_the_layer_is_priced_alone_nothing_communicated_and_no_host_term():
    record = json.loads((PROBE / "host_sync_layer_models.json").read_text())
    for probe in record["probes"]:
        step = layer_gpu.layer_step(probe, 4096, "H100")
        assert step.gpu == "H100" and step.chunk_layers == [1]
        assert all(step.terms_s[k] == 0 for k in ("ep_alltoall", "tp_comm", "pp_p2p", "pp_bubble", "dp_comm",
                                                  "host_sync"))
        assert layer_gpu.planned_layer_s(probe, 4096, "H100") == sum(step.terms_s[k] for k in layer_gpu.GPU_TERMS)


def test_a_probe_of_the_moe_block_alone_is_refused():
    record = json.loads((PROBE / "host_sync.json").read_text())
    with pytest.raises(SystemExit, match="MoE block alone"):
        layer_gpu.compare(record, "H100")
