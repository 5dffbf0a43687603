"""The megatron engine's options that are megatron-core mechanisms (recipe ``engine_options``; issue 34's
levers): each reaches the megatron-core config it names, unset keeps what the engine shipped before the
settings existed, and the combinations megatron-core or TE cannot run are refused. CPU: the pure config
builders; with megatron-core and TE importable, the real configs."""

from __future__ import annotations

import pytest
import torch

from muse_stack.engines.mcore.config import (
    ddp_config_kwargs,
    optimizer_config_kwargs,
    transformer_config_kwargs,
)
from muse_stack.engines.megatron_available import missing
from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.recipes.options import ROWS, check
from muse_stack.recipes.options import resolve as resolve_options
from muse_stack.resolve.recipe import finalize, resolve

MEGATRON_OPTIONS = [row.field for row in ROWS if "megatron" in row.engines]


def configs(*overrides: str) -> dict[str, dict]:
    recipe = load_recipe("slice-1gpu", list(overrides))
    return {"transformer": transformer_config_kwargs(recipe, recipe.model_config_resolved()),
            "optimizer": optimizer_config_kwargs(recipe), "ddp": ddp_config_kwargs(recipe),
            "clip": {"on_device": resolve_options(recipe)["clip_on_device"].value}}


#: what the engine ran before these settings existed (config.py and megatron.py as of issue 34):
#: permutation fused, router unfused, weight gradients accumulated into main_grad, the clip on
#: megatron-core's tensor path, no optimizer graph, the gradient reduce after the backward
SHIPPED = {("transformer", "moe_permute_fusion"): True, ("transformer", "moe_router_fusion"): False,
           ("transformer", "gradient_accumulation_fusion"): True, ("optimizer", "optimizer_cuda_graph"): False,
           ("ddp", "overlap_grad_reduce"): False, ("ddp", "grad_reduce_in_fp32"): True,
           ("ddp", "check_for_nan_in_grad"): False, ("clip", "on_device"): True}

#: each lever alone, as h200.sh's levers5 step sets it, and the one value it must change
LEVERS = [
    ("engine_options.gradient_accumulation=false", "transformer", "gradient_accumulation_fusion", False),
    ("engine_options.permute=false", "transformer", "moe_permute_fusion", False),
    ("engine_options.router=true", "transformer", "moe_router_fusion", True),
    ("engine_options.clip_on_device=false", "clip", "on_device", False),
    ("engine_options.optimizer_cuda_graph=true", "optimizer", "optimizer_cuda_graph", True),
    ("engine_options.overlap_grad_reduce=true", "ddp", "overlap_grad_reduce", True),
]


def test_unset_is_what_the_engine_shipped():
    recipe = load_recipe("slice-1gpu")
    assert all(getattr(recipe.engine_options, f.split(".")[1]) is None for f in MEGATRON_OPTIONS
               if f != "engine_options.compile_elementwise")  # the slice states that one
    got = configs()
    assert {key: got[part][key] for part, key in SHIPPED} == {key: v for (_, key), v in SHIPPED.items()}
    assert got["ddp"]["use_distributed_optimizer"] is True  # the slice's layout.distributed_optimizer


@pytest.mark.parametrize("override,part,key,value", LEVERS, ids=[o.split("=")[0] for o, *_ in LEVERS])
def test_each_lever_reaches_its_config_and_nothing_else(override, part, key, value):
    base, got = configs(), configs(override)
    assert got[part][key] == value != base[part][key]
    changed = {(p, k) for p in got for k in got[p] if got[p][k] != base[p][k]}
    assert changed == {(part, key)}


@pytest.mark.parametrize("override", [o for o, *_ in LEVERS])
def test_the_shipped_value_stated_changes_nothing(override):
    """Stating the shipped value (e.g. engine_options.permute=true) builds the same configs as leaving it unset."""
    field, value = override.split("=")
    shipped = {"false": "true", "true": "false"}[value]
    assert configs(f"{field}={shipped}") == configs()


@pytest.mark.parametrize("field", MEGATRON_OPTIONS)
def test_the_reference_engine_refuses_each_setting(field):
    with pytest.raises(RecipeError) as err:
        resolve(load_recipe("tiny-cpu", [f"{field}=true"]))
    assert err.value.field == field and "megatron" in err.value.fix


def test_refused_combinations_name_the_field_and_the_fix():
    cases = [
        (["engine_options.router=true", "numerics.deterministic=true"], "engine_options.router",
         "drop engine_options.router"),
        (["engine_options.optimizer_cuda_graph=true", "engine_options.clip_on_device=false"],
         "engine_options.optimizer_cuda_graph", "clip_on_device"),
        (["engine_options.optimizer_cuda_graph=true", "optimizer.param_remainders=true"],
         "engine_options.optimizer_cuda_graph", "optimizer.param_remainders=false"),
    ]
    for overrides, field, fix in cases:
        recipe = load_recipe("slice-1gpu", overrides)
        for build in (check, optimizer_config_kwargs,
                      lambda r: transformer_config_kwargs(r, r.model_config_resolved())):
            with pytest.raises(RecipeError) as err:
                build(recipe)
            assert err.value.field == field and fix in err.value.fix, overrides
    # each half of a refused pair alone is accepted
    for override in ("engine_options.router=true", "numerics.deterministic=true", "engine_options.clip_on_device=false",
                     "optimizer.param_remainders=true", "engine_options.optimizer_cuda_graph=true"):
        check(load_recipe("slice-1gpu", [override]))


def test_the_engine_check_refuses_before_any_gpu_work():
    """``muse-stack check`` runs the engine's recipe check (engines.spec), which builds the
    TransformerConfig arguments, so a refused pair fails there and not on a lent GPU."""
    from muse_stack.engines.spec import _check_megatron

    _check_megatron(finalize(load_recipe("slice-1gpu", ["engine_options.optimizer_cuda_graph=true"])))
    with pytest.raises(RecipeError):
        _check_megatron(finalize(load_recipe("slice-1gpu", ["engine_options.optimizer_cuda_graph=true",
                                                            "engine_options.clip_on_device=false"])))


needs_megatron = pytest.mark.skipif(not torch.cuda.is_available() or missing() is not None,
                                    reason=f"needs CUDA, Transformer Engine and megatron-core ({missing()})")


@pytest.mark.gpu
@needs_megatron
@pytest.mark.parametrize("override", ["", *(o for o, *_ in LEVERS)])
def test_megatron_core_accepts_each_lever(override):
    """The field names and values are megatron-core's own: its TransformerConfig, OptimizerConfig
    and DistributedDataParallelConfig take them and hold them."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from muse_stack.engines.mcore.config import transformer_config

    recipe = load_recipe("slice-1gpu", [override] if override else [])
    built = transformer_config(recipe, recipe.model_config_resolved())
    kw = transformer_config_kwargs(recipe, recipe.model_config_resolved())
    for key in ("moe_permute_fusion", "moe_router_fusion", "gradient_accumulation_fusion"):
        assert getattr(built, key) == kw[key]
    opt = OptimizerConfig(**optimizer_config_kwargs(recipe), params_dtype=built.params_dtype)
    assert opt.optimizer_cuda_graph == optimizer_config_kwargs(recipe)["optimizer_cuda_graph"]
    ddp = DistributedDataParallelConfig(**ddp_config_kwargs(recipe))
    assert ddp.overlap_grad_reduce == ddp_config_kwargs(recipe)["overlap_grad_reduce"]


@pytest.mark.gpu
@needs_megatron
def test_the_shipped_clip_reads_no_norm_on_the_host():
    """megatron-core's clip takes its tensor path when TE provides multi_tensor_scale_tensor
    (megatron/core/optimizer/clip_grads.py): the coefficient is computed and applied on the GPU,
    which CUDA's sync debug mode proves (a host read raises there). The engine ships this path;
    the graph wrapper of engine_options.optimizer_cuda_graph exists in this megatron-core."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.optimizer_cuda_graph import OptimizerCudaGraphWrapper  # noqa: F401

    assert clip_grads.multi_tensor_scale_tensor_impl is not None
    param = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    param.grad = torch.full((4,), 2.0, device="cuda")
    norm = torch.tensor([4.0], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=norm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the coefficient 1 / (4 + 1e-6) in fp32 (two roundings: the sum, the quotient) against the double value
    # rounded to fp32 (a third): each at most half an fp32 ulp, 2^-24 relative, so within 3 x 2^-24 < 2^-21
    assert torch.allclose(param.grad, torch.full((4,), 2.0 / (4.0 + 1e-6), device="cuda"), rtol=2**-21, atol=0)
