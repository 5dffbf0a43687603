"""The engine's Triton Adam step (muse_stack.engines.mcore.adam_step), run under Triton's interpreter through the
FusedAdam bookkeeping it replaces, against one Adam update in fp64 from the same fp32 inputs, within the bounds
derived in tests/helpers/adam_bounds.py. The interpreter checks are tests/helpers/adam_step_checks.py, each in its own process
(TRITON_INTERPRET=1 must be set before Triton is first imported). Here too: when the step applies, and the recipe
check of engine_options.triton_adam."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from adam_bounds import bias_corrections as te_bias_corrections

from muse_stack.util.errors import RecipeError
from muse_stack.recipes.catalogue import load_recipe

pytest.importorskip("triton")

CHECKS = Path(__file__).resolve().parents[1] / "helpers" / "adam_step_checks.py"


@pytest.mark.parametrize("check", ["steps", "steps:0:0", "unaligned", "replaced", "tight", "nan"])
def test_adam_step(check):
    root = str(CHECKS.parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, str(CHECKS.parent), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(CHECKS), check], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"ok {check}"


@pytest.mark.parametrize("step", [1, 2, 10, 1000])
def test_the_bias_corrections_are_te_hosts(step):
    from muse_stack.engines.mcore import adam_step

    assert adam_step.bias_corrections(0.9, 0.95, step, True) == te_bias_corrections(0.9, 0.95, step)
    assert adam_step.bias_corrections(0.9, 0.95, step, False) == (1.0, 1.0)
    # the beta rounded to fp32 first: 1 - 0.9**1 in double is not the fp32 value TE's host computes
    if step == 1:
        assert adam_step.bias_corrections(0.9, 0.95, 1, True)[0] == float(np.float32(1 - float(np.float32(0.9))))


class _Adam:
    def __init__(self, **kw):
        self.adam_w_mode, self.capturable, self.master_weights = 1, False, True
        self.master_weight_dtype = self.exp_avg_dtype = self.exp_avg_sq_dtype = torch.float32
        self.store_param_remainders = False
        self.param_groups = [dict(params=[torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])]
        self.__dict__.update(kw)


FusedAdam = type("FusedAdam", (_Adam,), {})


@pytest.mark.parametrize("kw, why", [
    (dict(capturable=True), "capturable"),
    (dict(master_weights=False), "fp32 master"),
    (dict(store_param_remainders=True), "int16 remainders"),
    (dict(exp_avg_dtype=torch.bfloat16), "moments are not fp32"),
    (dict(param_groups=[dict(params=[torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])]), "torch.float16"),
])
def test_what_the_step_does_not_run(kw, why):
    from muse_stack.engines.mcore import adam_step

    assert why in adam_step.unsupported(FusedAdam(**kw))
    assert adam_step.unsupported(FusedAdam()) is None
    assert "not Transformer Engine's FusedAdam" in adam_step.unsupported(_Adam())


def test_install_steps_every_fused_adam_or_none():
    from muse_stack.engines.mcore import adam_step

    class Distributed:
        def __init__(self, inner):
            self.optimizer = inner

    class Chained:
        def __init__(self, *opts):
            self.chained_optimizers = list(opts)

    a, b = FusedAdam(), FusedAdam()
    assert adam_step.install(Chained(Distributed(a), Distributed(b))) is None
    assert adam_step.installed(a) and adam_step.installed(b)
    c, d = FusedAdam(), FusedAdam(capturable=True)
    assert "capturable" in adam_step.install(Chained(Distributed(c), Distributed(d)))
    assert not adam_step.installed(c) and not adam_step.installed(d), "all or none"
    assert "no Transformer Engine FusedAdam" in adam_step.install(Distributed(torch.optim.SGD([torch.zeros(1)], 0.1)))
    # the engine option: off leaves TE's step, on installs (engine_options.triton_adam, as the engine calls it)
    e = FusedAdam()
    assert adam_step.install_triton_adam(SimpleNamespace(optimizer=Distributed(e)), False) is None
    assert not adam_step.installed(e)
    assert adam_step.install_triton_adam(SimpleNamespace(optimizer=Distributed(e)), True) is None
    assert adam_step.installed(e)


@pytest.mark.parametrize("overrides, why", [
    (["optimizer.precision_aware=false", "optimizer.param_remainders=null"], "precision_aware"),
    (["optimizer.param_remainders=true"], "param_remainders"),
    (["engine_options.optimizer_cuda_graph=true"], "optimizer_cuda_graph"),
])
def test_the_recipe_refuses_triton_adam_where_it_cannot_run(overrides, why):
    from muse_stack.recipes.options import check, why_not

    recipe = load_recipe("slice-1gpu", overrides)
    assert why in why_not(recipe, "triton_adam")
    check(recipe)  # unset: it applies where it can
    with pytest.raises(RecipeError) as err:
        check(load_recipe("slice-1gpu", [*overrides, "engine_options.triton_adam=true"]))
    assert err.value.field == "engine_options.triton_adam" and why in str(err.value)


def test_the_shipped_slice_can_step_through_it():
    from muse_stack.recipes.options import check, why_not

    recipe = load_recipe("slice-1gpu", ["engine_options.triton_adam=true"])
    assert why_not(recipe, "triton_adam") is None
    check(recipe)
