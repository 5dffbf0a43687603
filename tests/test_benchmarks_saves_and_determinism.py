"""The committed save-cost, export round-trip and deterministic-mode measurements say what the
benchmarks README says, and the deterministic verdicts follow from the runs' own metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse_stack.compare import compare_runs

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
README = (BENCH / "README.md").read_text()


@pytest.mark.parametrize("recipe", ["proxy-1gpu", "slice-1gpu"])
def test_deterministic_verdict_follows_from_the_metrics(recipe):
    committed = json.loads((BENCH / "det" / f"{recipe}-det-compare.json").read_text())["bitwise"]
    again = compare_runs(BENCH / "det" / f"{recipe}-det-a", BENCH / "det" / f"{recipe}-det-b", make_plot=False).bitwise
    assert again == committed
    # what the README reports: not identical, first apart at step 1
    assert again["identical"] is False and again["first_difference"]["step"] == 1
    assert "not yet bitwise" in README
    for run in ("det-a", "det-b"):
        fp = json.dumps(json.loads((BENCH / "det" / f"{recipe}-{run}" / "fingerprint.json").read_text()))
        assert '"deterministic": true' in fp and '"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"' in fp


def test_save_cost_table_restates_the_measurement():
    doc = json.loads((BENCH / "ckpt-save" / "ckpt-save.json").read_text())
    assert doc["sync"]["bytes"] == doc["async"]["bytes"] > 5e10  # the slice's whole training state
    row_sync = f"| synchronous | {doc['sync']['blocking_s']:.1f} s | {doc['sync']['complete_s']:.1f} s |"
    row_async = (f"| asynchronous | {doc['async']['blocking_s']:.2f} s | {doc['async']['complete_s']:.1f} s "
                 f"({doc['async']['steps_during_write']} steps later) | "
                 f"+{1000 * doc['async']['mean_excess_during_write_s']:.1f} ms per step")
    assert row_sync in README and row_async in README
    assert f"{doc['async']['step_time_cost_s']:.2f} s" in README and f"{doc['sync']['step_time_cost_s']:.1f} s" in README


def test_export_round_trip_passed_bit_for_bit():
    doc = json.loads((BENCH / "export-roundtrip" / "export-roundtrip.json").read_text())
    assert doc["passed"] and doc["mismatched"] == []
    assert doc["tensors_bitwise_equal"] == doc["tensors_compared"] == 131
    assert doc["logits_rel_rms_engine_bf16_vs_reference_fp32"] <= 1.5 * doc["logits_rel_rms_reference_bf16_vs_fp32"]
    assert f"{doc['tensors_compared']} engine tensors are" in README
