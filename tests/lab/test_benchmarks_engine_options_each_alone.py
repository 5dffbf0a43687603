"""Issue 34's levers (benchmarks/results/engine-options-each-alone/) and the side-by-side sittings
(benchmarks/results/side-by-side/): the keep-or-reject rule, its verdict and each sitting's summary recomputed from
the committed result files (the READMEs' figures are rendered from the same files: test_benchmarks_rendered.py).
CPU only; nothing is timed."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
from bench_results import RESULTS, script

LEVERS = RESULTS / "engine-options-each-alone"
SBS = RESULTS / "side-by-side"
SITTINGS = ("2026-12-02", "2026-12-03", "2026-12-03-clip-skip-and-gated-residual", "2026-12-03-early-expert-counts-and-pre-mlp-norm", "2026-12-03-te-swiglu-backward-and-first-microbatch-writes", "2026-12-03-triton-adam", "2026-12-04")
#: the like-for-like sitting (Bridge given the engine's own mapping of the recipe), on an H100 with the slice cut to fit
LIKE = "2026-12-08-like-for-like-h100"
levers_choose = script("levers_choose")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_rule_on_made_up_runs(tmp_path):
    """Kept only above twice the shipped runs' drift (here 1%, so 2%) and above 0.5%; a missing run is no gain."""
    for name, tps in {"shipped": 100.0, "shipped-again": 101.0, "router-fusion": 103.6,
                      "optimizer-cuda-graph": 102.0, "no-permute-fusion": 90.0}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"tokens_per_s_per_gpu": tps}))
    rows, kept, threshold = levers_choose.choose(tmp_path)
    assert threshold == pytest.approx(2 * 1 / 100.5)
    assert kept == ["fusions.router=true"]  # +3.1%; the graph's +1.5% is under 2%
    by = {r["lever"]: r for r in rows}
    assert by["clip-host-sync"]["gain"] is None and not by["clip-host-sync"]["kept"]
    (tmp_path / "shipped-again.json").unlink()
    with pytest.raises(SystemExit, match="shipped-again"):
        levers_choose.choose(tmp_path)


def test_the_committed_choice_is_the_rule_applied_to_the_committed_runs(capsys):
    assert levers_choose.main([str(LEVERS)]) == 0
    printed = capsys.readouterr().out
    assert printed == (LEVERS / "choice.txt").read_text()
    rows, kept, threshold = levers_choose.choose(LEVERS)
    assert kept == [] and len(rows) == 6 and all(r["gain"] is not None for r in rows)
    assert f"{100 * threshold:.2f}%" == "0.88%"


def test_each_run_set_what_its_file_says():
    """Each run's settings, read back off megatron-core (the README's table is rendered from these files)."""
    runs = sorted(p.stem for p in LEVERS.glob("*.json") if p.name not in ("fingerprint.json", "result.json"))
    assert len(runs) == 8
    assert _json(LEVERS / "optimizer-cuda-graph.json")["levers"]["optimizer_cuda_graph"].startswith("captured")
    assert _json(LEVERS / "router-fusion.json")["levers"]["moe_router_fusion"] is True
    assert _json(LEVERS / "no-permute-fusion.json")["levers"]["moe_permute_fusion"] is False
    losses = [_json(LEVERS / f"{run}.json")["final_loss"] for run in runs]
    assert max(losses) / min(losses) - 1 < 1e-3  # the settings train to the same loss ("agree to 7e-4")


def _bridge(folder: Path) -> dict:
    """A Bridge run's result: its bridge-slice.json, or where that file did not come back from the device
    (2026-12-03-te-swiglu-backward-and-first-microbatch-writes/bridge3, as its README says), the same result as the run printed it, the log's last line."""
    if (folder / "bridge-slice.json").exists():
        return _json(folder / "bridge-slice.json")
    return json.loads((folder / "bridge-iterations.log").read_text().strip().splitlines()[-1])


def test_only_the_sitting_that_says_so_lacks_a_bridge_file():
    missing = sorted(str(p.parent.relative_to(SBS)) for p in SBS.glob("*/bridge*/bridge-iterations.log")
                     if not (p.parent / "bridge-slice.json").exists())
    assert missing == ["2026-12-03-te-swiglu-backward-and-first-microbatch-writes/bridge3"]
    assert "`bridge3/` holds the run's log but not its `bridge-slice.json`" in (SBS / "README.md").read_text()


@pytest.mark.parametrize("sitting", (*SITTINGS, LIKE))
def test_each_sitting_summary_is_its_runs(sitting):
    folder = SBS / sitting
    runner = [_json(folder / f"runner{i}" / "results.json") for i in (1, 2, 3)]
    bridge = [_bridge(folder / f"bridge{i}") for i in (1, 2, 3)]
    s = _json(folder / "summary.json")
    assert s["runner_median"] == statistics.median(r["tokens_per_s_per_gpu"] for r in runner)
    assert s["bridge_median"] == statistics.median(b["tokens_per_s_per_gpu"] for b in bridge)
    assert s["ratio_of_medians"] == pytest.approx(s["runner_median"] / s["bridge_median"], rel=1e-15)
    for r in runner:  # every window step within 1.2x its run's median: no stall
        assert r["step_time_worst_ratio"] < 1.2


def test_the_profile_reading_follows_from_the_profile():
    """What the README reads off the second sitting's profile (its figures are rendered from it)."""
    p = _json(SBS / "2026-12-03" / "profile-shipped.json")
    bins = {b["gap_us"]: b for b in p["idle_by_gap_length"]}
    assert sum(b["seconds_per_step"] for b in bins.values()) == pytest.approx(p["idle_seconds_per_step"], rel=1e-9)
    gaps = p["longest_gaps"]
    assert len(gaps) == 12 and min(g["seconds"] for g in gaps) >= 0.5e-3
    assert max(g["runtime_call_share"] for g in gaps) <= 0.07  # "more than 7% of the gap" in no gap
    places = {re.sub(r"\[\[.*?\]\]", "", g["operators"]).split(" > ")[0] for g in gaps}
    assert places == {"aten::to", "_GroupedLinear", "te_moe::permute_mask_map_fwd"}, places


def test_the_last_sitting_ran_the_recipe_as_shipped_above_53_percent():
    runner = [_json(SBS / SITTINGS[-1] / f"runner{i}" / "results.json") for i in (1, 2, 3)]
    assert statistics.median(r["mfu"] for r in runner) >= 0.53
    for r in runner:  # as shipped: no override in the run's recipe
        assert r["recipe"] == "slice-1gpu"
    sixth = [_json(SBS / "2026-12-03-triton-adam" / f"runner{i}" / "results.json") for i in (1, 2, 3)]
    assert statistics.median(r["mfu"] for r in sixth) < 0.53  # "was short of 53%"


def test_the_ratio_grew_with_each_attributed_change():
    """The README's reading: the runner is ahead of Bridge in every sitting, by more with each change."""
    ratios = [_json(SBS / s / "summary.json")["ratio_of_medians"] for s in SITTINGS]
    assert all(r > 1 for r in ratios) and ratios[2:] == sorted(ratios[2:])


def test_the_like_for_like_sitting_gave_bridge_the_runners_settings_on_the_runners_shape():
    """What the side-by-side README says of the like-for-like sitting: Bridge ran with gradient-accumulation fusion
    (its output layer's weight gradient by TE's GEMM, APEX being absent) and the precision-aware optimizer, every
    mapped recipe field taken; the runner ran the very recipe Bridge was given (its fingerprint's recipe hash is the
    shipped recipe with Bridge's overrides); the card differs from the H200 sittings'; the ratio is short of the
    1.05x issue 53 asks; and the one setting both record that still differs is the router's fusion."""
    import hashlib

    from muse_stack.recipes.catalogue import load_recipe, recipe_yaml

    folder = SBS / LIKE
    bridge = [_json(folder / f"bridge{i}" / "bridge-slice.json") for i in (1, 2, 3)]
    runner = [_json(folder / f"runner{i}" / "results.json") for i in (1, 2, 3)]
    prints = [_json(folder / f"runner{i}" / "fingerprint.json") for i in (1, 2, 3)]
    for b in bridge:
        assert b["settings"]["gradient_accumulation_fusion"] is True
        assert b["settings"]["use_precision_aware_optimizer"] is True
        assert "Transformer Engine" in b["output_layer_wgrad_accumulation"]
        assert b["recipe_fields_without_provider_field"] == []
        assert b["settings"]["moe_router_fusion"] is True
        assert b["overrides"] == bridge[0]["overrides"]
    overrides = bridge[0]["overrides"]
    assert "hardware.gpu=H100" in overrides
    # the runner's and Bridge's overrides are the same: each runner's recipe.yaml is the recipe that ran (its sha256
    # is the fingerprint's), and it is slice-1gpu with Bridge's overrides (read with today's schema), not as shipped
    shaped = recipe_yaml(load_recipe("slice-1gpu", overrides))
    for i, p in enumerate(prints, 1):
        text = (folder / f"runner{i}" / "recipe.yaml").read_text()
        assert hashlib.sha256(text.encode("utf-8")).hexdigest() == p["run_inputs"]["recipe_sha256"]
        assert recipe_yaml(load_recipe(str(folder / f"runner{i}" / "recipe.yaml"))) == shaped
    assert shaped != recipe_yaml(load_recipe("slice-1gpu"))
    for r in runner:
        assert r["engine_info"]["levers"]["gradient_accumulation_fusion"] is True
        assert r["engine_info"]["levers"]["moe_router_fusion"] is False
        assert r["flops_per_token"]["training"] == bridge[0]["flops_per_token"]
    assert {p["gpu"]["names"][0] for p in prints} == {"NVIDIA H100 80GB HBM3"}
    h200 = _json(SBS / SITTINGS[-1] / "runner1" / "fingerprint.json")["gpu"]["names"]
    assert "NVIDIA H100 80GB HBM3" not in h200
    assert 1 < _json(folder / "summary.json")["ratio_of_medians"] < 1.05

