"""The distributed optimizer's parameter positions with fp32 and bf16 parameters in one group
(pure bookkeeping: megatron-core's objects are stood in for by plain ones)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from muse_stack.engines.mcore.optimizer_order import align_group_orders


class P:
    """A parameter stand-in: hashable by identity, as torch parameters are."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def build(dtypes: list[str]):
    """One group whose buffer order is ``dtypes``, laid out as megatron-core 0.19 does."""
    model = [P(f"m{i}-{d}") for i, d in enumerate(dtypes)]
    shard = {m: P(f"s-{m.name}") for m in model}
    fp32 = [m for m, d in zip(model, dtypes) if d == "fp32"]
    half = [m for m, d in zip(model, dtypes) if d == "bf16"]
    opt = SimpleNamespace(
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        model_param_group_index_map={m: (0, i) for i, m in enumerate(model)},  # buffer order
        model_fp32_groups=[fp32], shard_fp32_groups=[[shard[m] for m in fp32]],
        model_float16_groups=[half], shard_fp32_from_float16_groups=[[shard[m] for m in half]],
        shard_float16_groups=[[None for _ in half]],
        optimizer=SimpleNamespace(param_groups=[{"params": [shard[m] for m in fp32] + [shard[m] for m in half]}]))
    return opt, shard


@given(st.lists(st.sampled_from(["fp32", "bf16"]), min_size=1, max_size=30))
def test_every_parameter_points_at_its_own_shard(dtypes):
    opt, shard = build(dtypes)
    align_group_orders(SimpleNamespace(chained_optimizers=[opt]))
    params = opt.optimizer.param_groups[0]["params"]
    for model_param, (group, order) in opt.model_param_group_index_map.items():
        assert group == 0 and params[order] is shard[model_param]


def test_interleaved_dtypes_are_what_goes_wrong_and_gets_fixed():
    opt, _ = build(["bf16", "fp32", "bf16", "fp32"])
    assert align_group_orders(opt) == 4
    opt, _ = build(["fp32", "fp32", "bf16"])  # fp32 first: megatron-core's order is already right
    assert align_group_orders(opt) == 0


def test_non_distributed_optimizers_are_left_alone():
    assert align_group_orders(SimpleNamespace(chained_optimizers=[SimpleNamespace(param_groups=[])])) == 0
