from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_stack.util.errors import LayoutError
from muse_stack.recipes.layout import pack_alignment, stage_layers
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe, recipe_names
from muse_stack.recipes.schema import Layout


def test_sft_192_plan(cli):
    rc, out, _ = cli("plan", "sft-192", "--json")
    plan = json.loads(out)
    assert rc == 0
    assert plan["dp"] == 8
    assert plan["stages"] == [9, 11, 11, 11, 11, 9]
    assert plan["microbatches_per_replica"] == 16
    assert plan["steps_per_epoch"] == 85
    assert plan["stage_holds"]["0"][0] == "embedding" and plan["stage_holds"]["5"] == ["output layer"]
    assert plan["experts_per_ep_rank"] == 8


def test_attune_plan_fits_near_the_recorded_peak():
    recipe = load_recipe("attune-b200")
    plan, _ = make_plan(recipe)
    assert plan.dp == 4
    assert plan.stages == [3] + [4] * 14 + [3]
    assert plan.experts_per_ep_rank == 32
    assert plan.expert_dp == 1
    assert plan.fits is True and plan.peak_memory_gib < 178.35
    recorded = recipe.result.peak_memory_gib
    assert recorded == 157.8
    # the record's peak is memory *used* per GPU: the caching allocator's reserve, the CUDA context
    # and NCCL's buffers on top of what is allocated, which is what the plan estimates (calibrated
    # on allocated peaks); so the estimate sits below the record, by at most a quarter
    assert plan.peak_memory_gib < recorded
    assert (recorded - plan.peak_memory_gib) / recorded <= 0.25


def test_attune_at_ep4_does_not_fit(cli):
    plan, _ = make_plan(load_recipe("attune-b200", ["layout.ep=4"]))
    assert plan.experts_per_ep_rank == 64 and plan.fits is False
    rc, out, _ = cli("plan", "attune-b200", "layout.ep=4")
    assert rc == 1 and "does not fit" in out


def test_every_catalogue_recipe_validates():
    for name in recipe_names():
        plan, report = make_plan(load_recipe(name))
        assert report.ok, (name, report.errors)
        assert plan.world_size == load_recipe(name).hardware.count


def test_unstated_cp_is_reported_not_guessed(cli):
    plan, report = make_plan(load_recipe("lora-16-mm"))
    assert plan.dp is None and any("layout.cp" in u for u in report.unchecked)
    plan, report = make_plan(load_recipe("lora-16-mm", ["layout.cp=2"]))
    assert plan.dp == 2


BROKEN = [
    # (recipe, overrides, field, words in the rule)
    ("sft-192", ["hardware.count=190"], "hardware.count", "TP x PP x CP x DP"),
    ("sft-192", ["layout.dp=4"], "layout.dp", "DP = GPUs / (TP x PP x CP)"),
    ("sft-192", ["layout.ep=64", "layout.etp=1"], "layout.ep", "GPUs divisible by ETP x EP x PP"),
    ("sft-192", ["model.overrides.num_local_experts=200"], "layout.ep", "experts (200) divisible by EP"),
    ("sft-192", ["layout.pp_layers=[9, 11, 11, 11, 11, 10]"], "layout.pp_layers", "sum of stage layers = 62"),
    ("sft-192", ["layout.pp_layers=null"], "layout.pp", "62 layers divisible by PP"),
    ("attune-b200", ["layout.first_stage_layers=2"], "layout.first_stage_layers", "divisible by PP - 2"),
    ("sft-192", ["layout.tp=3", "hardware.count=144", "layout.ep=8", "layout.dp=null"], "layout.tp", "divisible by TP"),
    ("sft-192", ["batch.gbs=100"], "batch.gbs", "GBS divisible by MBS x DP"),
    ("sft-192-32k", ["batch.seq_length=32764"], "batch.seq_length", "lcm(2 x CP, TP x CP"),
    ("sft-192-32k", ["batch.pack_alignment=4"], "batch.pack_alignment", "lcm(2 x CP, TP x CP"),
    ("pretrain-192", ["layout.sequence_parallel=true"], "layout.sequence_parallel", "needs TP > 1"),
    ("sft-192", ["batch.mbs=2", "batch.gbs=256"], "batch.mbs", "offline packing needs MBS 1"),
    ("sft-192-32k", ["layout.cp_comm_type=p2p"], "layout.cp_comm_type", "rejects P2P"),
    ("sft-192-32k", ["model.overrides.num_key_value_heads=4"], "layout.cp", "KV heads per TP rank (4 / 4 = 1)"),
    ("sft-192", ["layout.sequence_parallel=false"], "layout.sequence_parallel", "MoE with TP > 1"),
]


@pytest.mark.parametrize("name,overrides,field,rule", BROKEN)
def test_broken_layouts_fail_with_their_rule(name, overrides, field, rule, cli):
    with pytest.raises(LayoutError) as exc:
        make_plan(load_recipe(name, overrides))
    assert exc.value.field == field
    assert rule in exc.value.rule
    assert exc.value.fix
    rc, _, err = cli("plan", name, *overrides)
    assert rc == 2 and field in err and "fix:" in err


def test_pack_alignment_rule():
    assert pack_alignment(load_recipe("sft-192-32k").layout) == 8
    assert pack_alignment(load_recipe("sft-192-coderforge-64k").layout) == 16
    assert pack_alignment(Layout(tp=1, cp=1)) == 1
    assert pack_alignment(Layout(tp=2, cp=4, sequence_parallel=False)) == 8
    assert pack_alignment(Layout(tp=4, cp=1, sequence_parallel=True)) == 1


@settings(max_examples=200, deadline=None)
@given(pp=st.integers(1, 20), first=st.integers(0, 10), last=st.integers(0, 10), layers=st.integers(1, 80))
def test_stage_split_sums_to_layers_when_it_resolves(pp, first, last, layers):
    stages = stage_layers(Layout(pp=pp, first_stage_layers=first, last_stage_layers=last), layers)
    if stages is not None:
        assert sum(stages) == layers and len(stages) == pp
        if pp > 1:
            assert stages[0] == first and stages[-1] == last


def test_layer_splits_of_the_architecture_notes():
    assert stage_layers(Layout(pp=8, first_stage_layers=7, last_stage_layers=7), 62) == [7] + [8] * 6 + [7]
    assert stage_layers(Layout(pp=16, first_stage_layers=3, last_stage_layers=3), 62) == [3] + [4] * 14 + [3]
    assert stage_layers(Layout(pp=4), 62) is None
    assert stage_layers(Layout(pp=2), 62) == [31, 31]
