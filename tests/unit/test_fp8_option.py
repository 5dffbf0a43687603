"""``precision: fp8``: a recipe option of the megatron engine, with TE's scaling recipe and format
stated, refused where it would not run as written (no GPU needed for any of this)."""

from __future__ import annotations

import pytest

from muse_stack.compare.classify import NUMERICS, classify
from muse_stack.engines.mcore.config import transformer_config_kwargs
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.resolve.recipe import resolve

FP8 = ["precision=fp8", "fp8.recipe=tensorwise", "fp8.format=hybrid", "layout.dispatcher=alltoall"]


def test_fp8_sets_te_fp8_gemms_on_bf16_weights():
    recipe = load_recipe("slice-1gpu", FP8)
    kw = transformer_config_kwargs(recipe, recipe.model_config_resolved())
    assert (kw["fp8"], kw["fp8_recipe"]) == ("hybrid", "tensorwise")
    assert kw["bf16"] and kw["params_dtype"] == "bfloat16"
    assert kw["moe_router_padding_for_quantization"]  # alltoall: the router pads
    bf16 = load_recipe("slice-1gpu")
    plain = transformer_config_kwargs(bf16, bf16.model_config_resolved())
    assert "fp8" not in plain and plain["bf16"]


@pytest.mark.parametrize("overrides,field", [
    (["precision=fp8", "fp8.format=hybrid", "layout.dispatcher=alltoall"], "fp8.recipe"),
    (["precision=fp8", "fp8.recipe=tensorwise", "layout.dispatcher=alltoall"], "fp8.format"),
    (["precision=fp8", "fp8.recipe=mxfp8", "fp8.format=hybrid", "layout.dispatcher=alltoall"], "fp8.recipe"),  # sm100 only
    (["fp8.recipe=tensorwise", "fp8.format=hybrid"], "fp8"),  # settings without precision: fp8
    (["precision=fp8", "fp8.recipe=delayed", "fp8.format=hybrid", "recompute.granularity=full",
      "layout.dispatcher=alltoall"], "fp8.recipe"),
])
def test_fp8_is_refused_naming_the_field(overrides, field):
    with pytest.raises(RecipeError) as info:
        resolve(load_recipe("slice-1gpu", overrides))
    assert info.value.field == field


def test_fp8_on_the_shipped_allgather_dispatcher_pads_in_the_experts():
    """megatron-core refuses its router padding with allgather (TransformerConfig raises); there
    TEGroupedMLP pads each expert's rows itself, so the engine asks for no router padding."""
    recipe = load_recipe("slice-1gpu", FP8[:3])
    resolve(recipe)  # accepted as shipped
    assert recipe.layout.dispatcher == "allgather"
    kw = transformer_config_kwargs(recipe, recipe.model_config_resolved())
    assert kw["fp8"] == "hybrid" and kw["moe_router_padding_for_quantization"] is False


def test_fp8_on_the_reference_engine_is_refused():
    with pytest.raises(RecipeError) as info:
        resolve(load_recipe("tiny-cpu", FP8))
    assert info.value.field == "precision"


def test_mxfp8_is_accepted_on_blackwell():
    recipe = load_recipe("sft-192", ["precision=fp8", "fp8.recipe=mxfp8", "fp8.format=e4m3"])
    assert recipe.fp8.recipe == "mxfp8"


def test_diff_classifies_fp8_as_numerics():
    assert classify("recipe.fp8.recipe") == NUMERICS
    assert classify("recipe.fp8.format") == NUMERICS
    assert classify("recipe.precision") == NUMERICS
