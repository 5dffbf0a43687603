"""The step-time model's kernels: the engine's own Adam update, word-embedding gradient and post-expert
norm backward, or the stack's, each priced by its bytes at the share of the HBM bandwidth it measured
(CPU only; no test times anything: the bandwidths are read from the committed measurements)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from muse_stack.util.errors import InputError
from muse_stack.machine.hardware import GPUS
from muse_stack.plan.cost import (EMBEDDING_DENSE_TABLE_BYTES, EMBEDDING_DENSE_TOKEN_BYTES,
                                  EMBEDDING_MAIN_GRAD_TOKEN_BYTES, NORM_BACKWARD_BYTES, ONE_PASS_NORM_BACKWARD,
                                  StepKernels, TimeCalibration, step_kernels)
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MCORE = ROOT / "muse_stack" / "engines" / "mcore"
H200 = GPUS["H200"]
# a handful of float64 operations on the same inputs in another order: rounding <= ~1e-15 relative
REL = 1e-12
#: the defaults are written to 4 significant digits: relative rounding <= 5e-4
ROUNDED = 5e-4
SHIPPED = StepKernels(adam="triton", embedding_grad="main_grad", post_expert_norm_backward="one_pass")
OLDER = StepKernels(adam="te", embedding_grad="dense", post_expert_norm_backward="compiled")


def _constants(path: Path, *names: str) -> tuple[int, ...]:
    text = path.read_text()
    return tuple(int(re.search(rf"^{n} = (\d+)$", text, flags=re.M).group(1)) for n in names)


def _plan(overrides: list[str] | None = None, kernels: StepKernels | None = None, cal: TimeCalibration | None = None):
    plan, _ = make_plan(load_recipe("slice-1gpu", overrides or []), strict=False, time_calibration=cal,
                        kernels=kernels)
    return plan.time


def test_the_kernel_bandwidths_are_their_measurements():
    """Each share is the kernel's measured GB/s alone on an H200 over the datasheet's 4,800 GB/s: TE's
    Adam at its default chunk, the Triton step and the one-pass norm backward at the launch the engine
    ships, TorchInductor's norm backward as compiled by default."""
    cal = TimeCalibration()
    adam = json.loads((RESULTS / "adam" / "kernels.json").read_text())["adam"]
    assert adam["default_chunk_size"] == 65536
    programs, warps, block = _constants(MCORE / "adam_step.py", "PROGRAMS_PER_SM", "NUM_WARPS", "BLOCK")
    triton = next(x for x in adam["one Triton launch, launches"]
                  if (x["programs_per_sm"], x["num_warps"], x["block"]) == (programs, warps, block))
    norm = json.loads((RESULTS / "normbwd" / "kernels.json").read_text())["post_expert_norm"]
    launch = _constants(MCORE / "norm_backward.py", "PROGRAMS_PER_SM", "NUM_WARPS", "ROWS_PER_ITERATION")
    one_pass = next(x for x in norm["one Triton pass, launches (backward alone)"]
                    if (x["programs_per_sm"], x["num_warps"], x["rows_per_iteration"]) == launch)
    for field, gbps in (("adam_bandwidth_te", adam["chunk 65536"]["gb_per_s"]),
                        ("adam_bandwidth_triton", triton["step"]["gb_per_s"]),
                        ("norm_backward_bandwidth_compiled", norm["inductor default"]["backward"]["gb_per_s"]),
                        ("norm_backward_bandwidth_one_pass", one_pass["backward"]["gb_per_s"])):
        assert getattr(cal, field) == pytest.approx(gbps / H200.hbm_gbps, rel=ROUNDED), field
    # the norm's measured call moves the bytes the model counts: [131,072, 4,096] x 3 bf16 tensors
    assert one_pass["backward"]["min_bytes"] == NORM_BACKWARD_BYTES * 131_072 * 4_096


def test_the_engine_kernels_follow_the_engines_own_checks():
    """The planner prices the kernels the engine runs: its own where they apply (unset), the stack's
    where a recipe turns them off or cannot run them (the same checks the engine refuses ``true`` by)."""
    assert step_kernels(load_recipe("slice-1gpu")) == SHIPPED
    remainders = step_kernels(load_recipe("slice-1gpu", ["optimizer.param_remainders=true"]))
    assert remainders.adam == "te" and remainders.embedding_grad == "main_grad"
    assert step_kernels(load_recipe("slice-1gpu", ["optimizer.precision_aware=false",
                                                    "optimizer.param_remainders=null"])).adam == "te"
    assert step_kernels(load_recipe("slice-1gpu", ["performance.triton_adam=false"])).adam == "te"
    assert step_kernels(load_recipe("slice-1gpu", ["performance.embedding_into_main_grad=false"])).embedding_grad \
        == "dense"
    assert step_kernels(load_recipe("proxy-2gpu", ["layout.tp=2", "layout.ep=1"])).embedding_grad == "dense"
    lora = ["peft.scheme=lora", "peft.rank=8", "peft.targets=[self_attn.q_proj]"]
    assert step_kernels(load_recipe("slice-1gpu", lora)).embedding_grad == "frozen"


def test_the_norm_backward_the_planner_prices_is_the_one_the_engine_ships():
    """``ONE_PASS_NORM_BACKWARD`` (the planner cannot import the engine's layers, which import
    megatron-core) is ``MuseSparkExperts.fused_norm_backward`` as layers.py assigns it."""
    found = re.findall(r"^    fused_norm_backward: bool = (True|False)$", (MCORE / "layers.py").read_text(), flags=re.M)
    assert found == [str(ONE_PASS_NORM_BACKWARD)]


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
    eager = ["fusions.compile_elementwise=false"]
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
