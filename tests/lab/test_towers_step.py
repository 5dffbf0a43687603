"""benchmarks/scripts/towers_step.py runs end to end on a CPU with a small tower: its modes (three ways of
running the blocks, with fp32 and with bf16 activations, and with the variable-length attention, whose CPU stand-in
attends per window), each chained forward equal to its written one bit for bit, the compiled ones', the bf16
tower's and the varlen ones' differences reported, and its record as the GPU run writes it."""

import json

from bench_results import script

towers_step = script("towers_step")


def test_the_script_runs_its_modes_on_a_small_tower(tmp_path):
    out = tmp_path / "towers-step.json"
    config = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 48,
              "pos_emb_height": 6, "pos_emb_width": 6}
    assert towers_step.main(["--device", "cpu", "--config", json.dumps(config), "--grid", "1,8,12;1,6,6",
                             "--reps", "1", "--warmup", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["modes"]) == {"written", "chained", "compiled", "bf16-written", "bf16-chained", "bf16-compiled",
                                    "varlen-written", "varlen-bf16-written", "varlen-bf16-compiled"}
    assert all(row["fwd_bwd_ms"] > 0 for row in record["modes"].values())
    assert record["checks"]["chained_equals_written"] is True
    assert record["checks"]["bf16-chained_equals_written"] is True
    # the compiled chains' closeness is bounded chain by chain in tests/unit/test_towers_chains.py; the script
    # reports the tower's difference as a figure
    assert 0.0 <= record["checks"]["compiled_max_rel_diff"] < float("inf")
    assert 0.0 <= record["checks"]["bf16-compiled_max_rel_diff"] < float("inf")
    # bf16 activations round the residual stream: the tower's output moves (its bound against transformers' bf16
    # tower is tests/unit/test_towers_bf16_activations.py)
    assert record["checks"]["bf16_written_max_rel_diff"] > 0.0
    # the varlen tower's function is checked in tests/unit/test_towers_varlen_attention.py; the script reports
    # its difference from the grouped calls as a figure
    assert 0.0 <= record["checks"]["varlen-written_max_rel_diff"] < float("inf")
    assert record["patches"] == 8 * 12 + 6 * 6 and record["config"]["blocks"] == 2
    # the memory-bound bytes of a pass, as the planner counts them: fewer with bf16 activations (no casts, half the
    # bytes a pass); no kernels to time them against on a CPU
    rows = record["modes"]
    assert 0 < rows["bf16-written"]["counted_bytes"] < rows["written"]["counted_bytes"]
    assert rows["chained"]["counted_bytes"] <= rows["written"]["counted_bytes"]
    assert rows["compiled"]["counted_bytes"] is None and rows["bf16-compiled"]["counted_bytes"] is None
    assert all(row["kernel_ms"] is None and row["memory_bound_gbps"] is None for row in rows.values())
