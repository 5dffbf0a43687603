"""optimizer.precision_aware / optimizer.param_remainders: megatron-core's precision-aware
optimizer (TE's FusedAdam holds the master weights), as recipe fields: what megatron-core is
given, what is refused before a run writes anything, and what the planner counts."""

from __future__ import annotations

import pytest

from muse_stack.engines.mcore.config import optimizer_config_kwargs
from muse_stack.resolve.recipe import resolve
from muse_stack.engines.support import check_precision_aware
from muse_stack.util.errors import RecipeError
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe, recipe_yaml

ON = ["optimizer.precision_aware=true", "optimizer.param_remainders=true"]


def test_unset_is_megatron_cores_own_optimizer():
    kw = optimizer_config_kwargs(load_recipe("proxy-1gpu"))
    assert kw["use_precision_aware_optimizer"] is False and kw["store_param_remainders"] is False
    assert kw["use_distributed_optimizer"] is True


def test_the_fields_reach_megatron_core_and_the_recipe_hash():
    kw = optimizer_config_kwargs(load_recipe("proxy-1gpu", ON))
    assert kw["use_precision_aware_optimizer"] is True and kw["store_param_remainders"] is True
    fp32 = optimizer_config_kwargs(load_recipe("proxy-1gpu", [ON[0], "optimizer.param_remainders=false"]))
    assert fp32["use_precision_aware_optimizer"] is True and fp32["store_param_remainders"] is False
    assert recipe_yaml(load_recipe("proxy-1gpu", ON)) != recipe_yaml(load_recipe("proxy-1gpu"))


def test_the_other_optimizer_values_are_the_recipes():
    r = load_recipe("proxy-1gpu", ON)
    kw = optimizer_config_kwargs(r)
    o = r.optimizer
    assert (kw["lr"], kw["min_lr"], kw["weight_decay"], kw["adam_beta1"], kw["adam_beta2"], kw["adam_eps"],
            kw["clip_grad"]) == (o.lr, o.min_lr, o.weight_decay, o.beta1, o.beta2, o.eps, o.clip_grad)
    assert kw["bf16"] is True


def test_bridge_keys_are_the_same_fields():
    bridge = ["optimizer.use_precision_aware_optimizer=true", "optimizer.store_param_remainders=true"]
    assert recipe_yaml(load_recipe("proxy-1gpu", bridge)) == recipe_yaml(load_recipe("proxy-1gpu", ON))


def test_a_valid_setting_passes_the_runners_checks():
    resolve(load_recipe("proxy-1gpu", ON))
    resolve(load_recipe("proxy-1gpu", [ON[0], "optimizer.param_remainders=false"]))


@pytest.mark.parametrize("overrides, field, fix", [
    ([ON[0]], "optimizer.param_remainders", "optimizer.param_remainders=true"),
    (["optimizer.param_remainders=true"], "optimizer.param_remainders", "optimizer.precision_aware=true"),
    ([*ON, "layout.distributed_optimizer=false"], "layout.distributed_optimizer", "distributed_optimizer=true"),
    ([*ON, "precision=fp32"], "optimizer.param_remainders", "param_remainders=false"),
])
def test_refused_naming_the_field_and_the_fix(overrides, field, fix):
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe("proxy-1gpu", overrides))
    assert exc.value.field == field and fix in exc.value.fix and exc.value.exit_code == 2


def test_refused_with_adapters():
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe("lora-64", ON))
    assert exc.value.field == "optimizer.precision_aware" and "optimizer.precision_aware=false" in exc.value.fix
    check_precision_aware(load_recipe("lora-64", ["optimizer.precision_aware=false"]))  # the fix is accepted


def test_refused_on_the_reference_engine():
    with pytest.raises(RecipeError) as exc:
        resolve(load_recipe("tiny-cpu", ["optimizer.precision_aware=true"]))
    assert "megatron engine only" in exc.value.render()


def test_the_planner_counts_two_bytes_less_per_parameter_with_remainders():
    base, _ = make_plan(load_recipe("slice-1gpu", ["optimizer.precision_aware=false"]))
    rem, _ = make_plan(load_recipe("slice-1gpu", ON))
    sep, _ = make_plan(load_recipe("slice-1gpu", [ON[0], "optimizer.param_remainders=false"]))
    for b, r, s in zip(base.memory, rem.memory, sep.memory):
        # DP 1: every trainable parameter's Adam state is on the GPU, 12 B each (fp32 master and
        # two moments) or 10 B (int16 remainder and two moments); a separate fp32 master is 12 B.
        # Same integers divided by the same GIB: equal up to one rounding of each quotient.
        assert r.optimizer_gib == pytest.approx(b.optimizer_gib * 10 / 12, rel=1e-12)
        assert s.optimizer_gib == pytest.approx(b.optimizer_gib, rel=1e-12)
        assert r.weights_gib == b.weights_gib and r.grads_gib == b.grads_gib


def test_one_formula_for_the_optimizer_state_the_planner_and_the_checkpoint_count():
    from muse_stack.engines.support import optimizer_state_bytes

    assert optimizer_state_bytes(load_recipe("slice-1gpu")) == 12  # separate fp32 master + two moments
    assert optimizer_state_bytes(load_recipe("slice-1gpu", ["optimizer.param_remainders=true"])) == 10
    assert optimizer_state_bytes(load_recipe("slice-1gpu", ["precision=fp32", "optimizer.param_remainders=false"])) == 8


def test_each_group_takes_its_multipliers_as_megatron_cores_scheduler_gives_them():
    """The engine sets the learning rate itself, not through megatron-core's OptimizerParamScheduler, which is what
    multiplies each group's ``lr_mult`` and ``wd_mult`` in. megatron-core's standard overrides put the parameters
    of one dimension and the biases in a group of ``wd_mult`` 0: without the multipliers that group would take the
    optimizer's default decay (the norms' gains decayed, which the reference and Megatron-Bridge never do)."""
    from muse_stack.engines.mcore.config import group_schedule

    plain, exempt = {"params": []}, {"params": [], "wd_mult": 0.0, "lr_mult": 1.0}
    decoupled = {"params": [], "wd_mult": 1.0, "lr_mult": 0.5}
    assert group_schedule(plain, 3e-4, 0.1) == (3e-4, 0.1)
    assert group_schedule(exempt, 3e-4, 0.1) == (3e-4, 0.0)
    assert group_schedule(decoupled, 3e-4, 0.1) == (1.5e-4, 0.1)
