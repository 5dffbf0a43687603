"""The planner's memory calibration against the committed H200 peaks, and the recompute and
expert-tensor-parallel terms it rests on (CPU only). That the calibration's values are fit.py's fit is
tests/lab/test_benchmarks_datafiles.py's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from muse_stack.plan.memory import layer_activation_bytes_per_token, selective_bytes_per_token
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe

FIT = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts" / "plan" / "fit.py"


@pytest.fixture(scope="module")
def fit():
    spec = importlib.util.spec_from_file_location("plan_fit", FIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fit()


def test_every_measured_peak_within_five_percent(fit):
    assert len([p for p in fit["points"] if not p["compiled"]]) >= 14
    assert len([p for p in fit["points"] if p["compiled"]]) >= 3
    for p in fit["points"]:
        assert abs(p["error_current"]) <= 0.05, p["benchmark"]


def peak(*overrides: str, recipe: str = "proxy-1gpu") -> float:
    plan, _ = make_plan(load_recipe(recipe, list(overrides)))
    return plan.memory[0].activations_gib


def test_selective_recompute_frees_what_each_module_stores():
    none = peak()
    assert peak("recompute.granularity=selective") == none  # core_attn: TE's fused core keeps nothing extra
    act, moe = (peak("recompute.granularity=selective", f"recompute.modules=[{m}]") for m in ("moe_act", "moe"))
    full = peak("recompute.granularity=full")
    assert full < moe < act < none
    m = load_recipe("proxy-1gpu").model_config_resolved()
    per_token = layer_activation_bytes_per_token(m, 1, False)
    assert per_token["recompute_moe_act"] == m.num_experts_per_tok * 2 * m.moe_intermediate_size
    assert selective_bytes_per_token(per_token, ["core_attn", "moe_act"])[0] == per_token["recompute_moe_act"]


def test_expert_tensor_parallel_ranks_hold_the_gathered_slots():
    m = load_recipe("proxy-2gpu").model_config_resolved()
    one, two = (layer_activation_bytes_per_token(m, 1, False, etp=e)["moe"] for e in (1, 2))
    assert two - one == m.num_experts_per_tok * 2 * 3 * m.moe_hidden_size
