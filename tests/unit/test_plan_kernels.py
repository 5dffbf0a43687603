"""The step-time model's kernels: the engine's own Adam update, word-embedding gradient and post-expert
norm backward, or the stack's, each priced by its bytes at the share of the HBM bandwidth it measured
(CPU only; no test times anything: the bandwidths are the calibration's, which
tests/lab/test_benchmarks_datafiles.py derives from the committed measurements)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from muse_stack.util.errors import InputError
from muse_stack.machine.hardware import GPUS
from muse_stack.plan.cost import (EMBEDDING_DENSE_TABLE_BYTES, EMBEDDING_DENSE_TOKEN_BYTES,
                                  EMBEDDING_MAIN_GRAD_TOKEN_BYTES, NORM_BACKWARD_BYTES, StepKernels,
                                  TimeCalibration, step_kernels)
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
H200 = GPUS["H200"]
# a handful of float64 operations on the same inputs in another order: rounding <= ~1e-15 relative
REL = 1e-12
SHIPPED = StepKernels(adam="triton", embedding_grad="main_grad", post_expert_norm_backward="one_pass")
OLDER = StepKernels(adam="te", embedding_grad="dense", post_expert_norm_backward="compiled")


def _plan(overrides: list[str] | None = None, kernels: StepKernels | None = None, cal: TimeCalibration | None = None):
    plan, _ = make_plan(load_recipe("slice-1gpu", overrides or []), strict=False, time_calibration=cal,
                        kernels=kernels)
    return plan.time


def test_the_norm_backward_call_moves_the_bytes_the_model_counts():
    """The measured call whose bandwidth share the planner uses moved [131,072, 4,096] x 3 bf16 tensors."""
    norm = json.loads((RESULTS / "normbwd" / "kernels.json").read_text())["post_expert_norm"]
    for row in (norm["inductor default"], *norm["one Triton pass, launches (backward alone)"]):
        assert row["backward"]["min_bytes"] == NORM_BACKWARD_BYTES * 131_072 * 4_096


def test_the_engine_kernels_follow_the_engines_own_checks():
    """The planner prices the kernels the engine runs: its own where they apply (unset), the stack's
    where a recipe turns them off or cannot run them (the same checks the engine refuses ``true`` by)."""
    assert step_kernels(load_recipe("slice-1gpu")) == SHIPPED
    remainders = step_kernels(load_recipe("slice-1gpu", ["optimizer.param_remainders=true"]))
    assert remainders.adam == "te" and remainders.embedding_grad == "main_grad"
    assert step_kernels(load_recipe("slice-1gpu", ["optimizer.precision_aware=false",
                                                    "optimizer.param_remainders=null"])).adam == "te"
    assert step_kernels(load_recipe("slice-1gpu", ["engine_options.triton_adam=false"])).adam == "te"
    assert step_kernels(load_recipe("slice-1gpu", ["engine_options.embedding_into_main_grad=false"])).embedding_grad \
        == "dense"
    assert step_kernels(load_recipe("proxy-2gpu", ["layout.tp=2", "layout.ep=1"])).embedding_grad == "dense"
    lora = ["peft.scheme=lora", "peft.rank=8", "peft.targets=[self_attn.q_proj]"]
    assert step_kernels(load_recipe("slice-1gpu", lora)).embedding_grad == "frozen"


def test_the_norm_backward_the_planner_prices_is_the_option_the_engine_installs():
    """The planner reads engine_options.one_pass_norm_backward as the engine resolves it: unset, the one pass;
    off, the compiled chain's."""
    assert step_kernels(load_recipe("slice-1gpu")).post_expert_norm_backward == "one_pass"
    off = load_recipe("slice-1gpu", ["engine_options.one_pass_norm_backward=false"])
    assert step_kernels(off).post_expert_norm_backward == "compiled"


def test_the_adam_update_is_its_bytes_at_its_kernels_share():
    cal = TimeCalibration()
    te = _plan(kernels=OLDER.model_copy(update={"embedding_grad": "main_grad"}))
    triton = _plan(kernels=SHIPPED)
    assert te.terms_s["optimizer"] * cal.adam_bandwidth_te == pytest.approx(
        triton.terms_s["optimizer"] * cal.adam_bandwidth_triton, rel=REL)
    # the slice's 4.33 B parameters, 30 bytes each, at the Triton step's share of 4,800 GB/s
    params = 4_329_152_512
    assert triton.terms_s["optimizer"] == pytest.approx(params * 30 / (H200.hbm_gbps * 1e9 * cal.adam_bandwidth_triton),
                                                        rel=1e-3)  # the plan's parameter count, not the engine's
    assert triton.kernels == SHIPPED and "the engine's Triton step" in " ".join(triton.assumptions)


def test_the_norm_backward_is_its_bytes_at_its_kernels_share():
    """One call a layer and micro-batch over the routed slots at the latent width; the compiled chain's
    at its share, the one pass at its own, an eager chain's inside the eager passes (no term)."""
    cal = TimeCalibration()
    recipe = load_recipe("slice-1gpu")
    m = recipe.model_config_resolved()
    one = _plan(kernels=SHIPPED)
    compiled = _plan(kernels=SHIPPED.model_copy(update={"post_expert_norm_backward": "compiled"}))
    tokens = recipe.batch.mbs * recipe.batch.seq_length
    call = NORM_BACKWARD_BYTES * m.num_experts_per_tok * tokens * m.moe_hidden_size / (H200.hbm_gbps * 1e9)
    calls = m.num_hidden_layers * one.microbatches
    want = calls * call * (1 / cal.norm_backward_bandwidth_compiled - 1 / cal.norm_backward_bandwidth_one_pass)
    assert compiled.terms_s["elementwise"] - one.terms_s["elementwise"] == pytest.approx(want, rel=1e-9)
    eager = ["engine_options.compile_elementwise=false"]
    eager_chain = _plan(eager, kernels=SHIPPED.model_copy(update={"post_expert_norm_backward": "compiled"}))
    eager_one = _plan(eager, kernels=SHIPPED)
    assert eager_one.terms_s["elementwise"] - eager_chain.terms_s["elementwise"] == pytest.approx(
        calls * call / cal.norm_backward_bandwidth_one_pass, rel=1e-9)


def test_the_embedding_gradient_is_its_bytes_at_hbm_bandwidth():
    recipe = load_recipe("slice-1gpu")
    m = recipe.model_config_resolved()
    tokens = recipe.batch.mbs * recipe.batch.seq_length
    times = {k: _plan(kernels=SHIPPED.model_copy(update={"embedding_grad": k})) for k in ("dense", "main_grad", "frozen")}
    micro = times["dense"].microbatches
    hbm = H200.hbm_gbps * 1e9
    dense = (m.vocab_size * EMBEDDING_DENSE_TABLE_BYTES + tokens * EMBEDDING_DENSE_TOKEN_BYTES) * m.hidden_size / hbm
    main = tokens * EMBEDDING_MAIN_GRAD_TOKEN_BYTES * m.hidden_size / hbm
    elementwise = {k: t.terms_s["elementwise"] for k, t in times.items()}
    assert elementwise["dense"] - elementwise["frozen"] == pytest.approx(micro * dense, rel=1e-9)
    assert elementwise["main_grad"] - elementwise["frozen"] == pytest.approx(micro * main, rel=1e-9)


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("plan_fit_time_kernels",
                                                  ROOT / "benchmarks" / "scripts" / "plan" / "fit_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_runs_kernels_are_read_from_its_record(ft):
    recipe = load_recipe("slice-1gpu")
    both = json.loads((RESULTS / "embedgrad" / "both.json").read_text())["levers"]
    assert ft.kernels_of(recipe, both) == SHIPPED
    te = json.loads((RESULTS / "adam" / "without.json").read_text())["levers"]
    assert ft.kernels_of(recipe, te) == OLDER  # it records no embedding_grad: the engine before that kernel
    # the sweep the calibration is fitted to ran the engine before all three
    for run in (RESULTS / "plan-sweep" / "runs").glob("*.json"):
        got = ft.kernels_of(recipe, json.loads(run.read_text())["levers"])
        assert got == OLDER, run.name
    assert ft.kernels_of(recipe, None) == OLDER
    with pytest.raises(InputError) as e:
        ft.kernels_of(recipe, {"adam_step": "a new kernel"})
    assert e.value.field == "adam_step" and "one Triton launch" in e.value.fix
