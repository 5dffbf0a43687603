"""The step-time refit on one machine's sweep (``fit_time.py --sweep``) and the terms it fits: the
dispatchers' permutation and the optimizer layouts (CPU only; no test times anything, and no step
time here is a measurement: each is the model's own, at coefficients the test chooses)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from muse_stack.machine.hardware import GPUS
from muse_stack.plan.cost import MASTER_COPY_BYTES, REMAINDER_BYTES, StepKernels, TimeCalibration, step_kernels
from muse_stack.plan.planner import make_plan
from muse_stack.recipes.catalogue import load_recipe

ROOT = Path(__file__).resolve().parents[2]
H200 = GPUS["H200"]
# a handful of float64 operations on the same inputs in another order: rounding <= ~1e-15 relative
REL = 1e-12
PA = ["optimizer.precision_aware=true", "optimizer.param_remainders=true"]
#: the runs of `h200.sh plansweep` (the shipped slice-1gpu and each neighbour of its settings)
SWEEP = {
    "shipped": [],
    "mbs2": ["batch.mbs=2"],
    "mbs8-remainders": [*PA, "batch.mbs=8"],
    "seq2048": ["batch.seq_length=2048"],
    "seq8192-mbs2": ["batch.seq_length=8192", "batch.mbs=2"],
    "recompute-full": ["recompute.granularity=full"],
    "topk2": ["model.overrides.num_experts_per_tok=2"],
    "topk4": ["model.overrides.num_experts_per_tok=4"],
    "alltoall": ["layout.dispatcher=alltoall"],
    "plain-dist-opt": ["optimizer.precision_aware=false", "optimizer.param_remainders=null"],
    "remainders": PA,
}
#: coefficients the synthetic step times are made with: every unknown the sweep fits, away from its
#: value before the sweep (fit_time.PRIOR); the host times (the sweep is GPU-bound) and the eager
#: passes (it is compiled) at PRIOR's, where the fit holds them
KNOWN = {"matmul_efficiency": 0.6, "elementwise_passes_compiled": 2.0, "dispatch_passes_allgather": 3.0,
         "dispatch_passes_alltoall": 6.0, "optimizer_copy_passes": 1.5, "remainder_passes": 2.5}
#: what the sweep holds at PRIOR
HELD = {"elementwise_passes", "expert_overhead_s", "layer_overhead_s", "microbatch_overhead_s"}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"plan_{name}", ROOT / "benchmarks" / "scripts" / "plan" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ft():
    return _module("fit_time")


def _cal(values: dict[str, float]) -> TimeCalibration:
    """``values`` over the calibration before the sweep (fit_time.PRIOR), where a sweep holds what
    its runs do not separate."""
    prior = _module("fit_time").PRIOR
    eff = values.get("matmul_efficiency", prior.gemm_efficiency_dense)
    fields = {k: v for k, v in values.items() if k != "matmul_efficiency"}
    return prior.model_copy(update=dict(gemm_efficiency_dense=eff, gemm_efficiency_expert=eff,
                                        attention_efficiency=eff, **fields))


def _step(overrides: list[str], cal: TimeCalibration) -> float:
    """The model's step with the kernels the engine runs for the recipe (as ``_write`` records them)."""
    plan, _ = make_plan(load_recipe("slice-1gpu", overrides), strict=False, time_calibration=cal)
    return plan.time.step_s


def _levers(kernels: StepKernels) -> dict[str, str]:
    """What the megatron engine records in ``levers`` for these kernels (muse_stack/engines/megatron.py)."""
    return {"adam_step": "one Triton launch per parameter group (adam_step.py)" if kernels.adam == "triton"
            else "Transformer Engine's multi_tensor_adam (it keeps fp32 master weights)",
            "embedding_grad": "each token's gradient added into the fp32 main gradient (embedding_grad.py)"
            if kernels.embedding_grad == "main_grad" else "a dense bf16 gradient added by megatron-core's DDP (x)",
            "post_expert_norm_backward": "one Triton pass (norm_backward.py)"
            if kernels.post_expert_norm_backward == "one_pass" else "the compiled chain's (TorchInductor)"}


def _write(folder: Path, steps: dict[str, float], runs: dict[str, list[str]] = SWEEP) -> Path:
    """Each run as engine_steps.py writes it, with the levers the engine records for its recipe."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, ov in runs.items():
        levers = _levers(step_kernels(load_recipe("slice-1gpu", ov)))
        (folder / f"{name}.json").write_text(json.dumps(
            {"recipe": "slice-1gpu", "overrides": ov, "device": "NVIDIA H200", "step_time_mean_s": steps[name],
             "levers": levers}))
    return folder


def test_h200_sweep_runs_are_the_ones_tested():
    """The runs above are the ones h200.sh plansweep makes (names and overrides)."""
    text = (ROOT / "benchmarks" / "scripts" / "h200.sh").read_text()
    block = text[text.index("  plansweep)"):]
    block = block[:block.index(";;")]
    pa = "optimizer.precision_aware=true optimizer.param_remainders=true"
    assert 'one $ES $overrides $W --out "$D/$name.json"' in block  # each line of the list below, as NAME OVERRIDES...
    listed = block[block.index("<<RUNS\n") + len("<<RUNS\n"):block.index("\nRUNS\n")]
    runs = {}
    for line in listed.splitlines():
        name, *overrides = line.replace("$PA", pa).split()
        runs[name] = sorted(overrides)
    assert runs == {n: sorted(ov) for n, ov in SWEEP.items()}


def test_the_dispatch_term_is_the_routed_slots_bytes_at_hbm_bandwidth():
    cal = TimeCalibration(dispatch_passes_allgather=3.0, dispatch_passes_alltoall=5.0)
    recipe = load_recipe("slice-1gpu")
    m = recipe.model_config_resolved()
    plan, _ = make_plan(recipe, strict=False, time_calibration=cal)
    t = plan.time
    tokens = recipe.batch.mbs * recipe.batch.seq_length
    slot_bytes = 2 * m.num_experts_per_tok * tokens * m.moe_hidden_size
    # forward and backward (1 x) per layer and micro-batch; the shipped slice's allgather dispatcher
    want = 3.0 * slot_bytes / (H200.hbm_gbps * 1e9) * 2 * m.num_hidden_layers * t.microbatches
    assert t.terms_s["dispatch"] == pytest.approx(want, rel=REL)
    other, _ = make_plan(load_recipe("slice-1gpu", ["layout.dispatcher=alltoall"]), strict=False, time_calibration=cal)
    assert other.time.terms_s["dispatch"] == pytest.approx(want * 5.0 / 3.0, rel=REL)
    # full recompute permutes once more in the recomputed forward
    full, _ = make_plan(load_recipe("slice-1gpu", ["recompute.granularity=full"]), strict=False, time_calibration=cal)
    assert full.time.terms_s["recompute"] - plan.time.terms_s["recompute"] >= want / 2 * (1 - REL)
    # no passes, no term
    none, _ = make_plan(recipe, strict=False, time_calibration=TimeCalibration(dispatch_passes_allgather=0.0))
    assert none.time.terms_s["dispatch"] == 0.0


def test_the_optimizer_layouts_add_their_bytes_at_hbm_bandwidth():
    cal = TimeCalibration(optimizer_copy_passes=1.5, remainder_passes=2.5)
    te = StepKernels(adam="te", embedding_grad="main_grad", post_expert_norm_backward="one_pass")
    times = {}
    for name, ov in (("aware", []), ("plain", SWEEP["plain-dist-opt"]), ("remainders", SWEEP["remainders"])):
        plan, _ = make_plan(load_recipe("slice-1gpu", ov), strict=False, time_calibration=cal, kernels=te)
        times[name] = plan.time.terms_s["optimizer"]
    # the Adam update's 30 bytes per parameter (at TE's kernel's share of the bandwidth) are the same in
    # each layout: the differences are the layouts' own, at the full bandwidth
    per_byte = times["aware"] / (30 / cal.adam_bandwidth_te)
    assert times["plain"] - times["aware"] == pytest.approx(per_byte * 1.5 * MASTER_COPY_BYTES, rel=1e-9)
    assert times["remainders"] - times["aware"] == pytest.approx(per_byte * 2.5 * REMAINDER_BYTES, rel=1e-9)


def test_the_sweep_fit_recovers_the_coefficients_the_step_times_were_made_with(ft, tmp_path):
    cal = _cal(KNOWN)
    steps = {n: _step(ov, cal) for n, ov in SWEEP.items()}
    out = ft.fit_sweep(_write(tmp_path / "sweep", steps))
    assert set(out["fitted"]) == set(KNOWN)
    assert set(out["held"]) == HELD
    assert {r["regime"] for r in out["points"]} == {"gpu"}
    # exact data: the least squares residual is float64 rounding amplified by the conditioning of
    # the scaled system (its weakest column is >= 1% apart from the others: <= 1e4 x 1e-15); 1e-8
    # leaves margin and still fails on any wrong factor
    for k, v in KNOWN.items():
        assert out["fitted"][k] == pytest.approx(v, rel=1e-8), k
    for r in out["points"]:
        assert abs(r["error"]) < 1e-8, r["run"]
    assert out["shipped"]["run"] == "shipped" and out["shipped"]["within_target"]
    # left out, a run is predicted exactly when the others still separate every unknown. Two runs
    # alone separate one: the alltoall dispatcher and megatron-core's optimizer layout. Left out, that
    # unknown is held at its value before the sweep (PRIOR: 0), not at the value the full fit gives
    # it; the prediction is then the model's with it at 0, as nothing else moves
    sole = {"alltoall": "dispatch_passes_alltoall", "plain-dist-opt": "optimizer_copy_passes"}
    for r in out["points"]:
        assert set(r["leave_one_out_held"]) == set(out["held"]) | ({sole[r["run"]]} if r["run"] in sole else set())
        if r["run"] not in sole:
            assert abs(r["leave_one_out_error"]) < 1e-8, r["run"]
        else:
            assert getattr(ft.PRIOR, sole[r["run"]]) == 0.0
            want = _step(SWEEP[r["run"]], _cal({**KNOWN, sole[r["run"]]: 0.0}))
            assert r["leave_one_out_predicted_s"] == pytest.approx(want, rel=1e-8), r["run"]
            assert r["leave_one_out_error"] < -1e-3


def test_leave_one_out_is_a_fit_to_the_other_runs(ft, tmp_path):
    """Step times off the model (a fixed +-3% pattern), so that in-sample and left-out predictions
    differ; each left-out prediction is the prediction of a fit to a folder without that run."""
    cal = _cal(KNOWN)
    wobble = dict(zip(SWEEP, [0.03, -0.02, 0.01, -0.03, 0.02, 0.0, 0.025, -0.015, 0.01, -0.01, 0.02]))
    steps = {n: _step(ov, cal) * (1 + wobble[n]) for n, ov in SWEEP.items()}
    out = ft.fit_sweep(_write(tmp_path / "all", steps))
    rows = {r["run"]: r for r in out["points"]}
    for left in ("topk2", "remainders", "seq8192-mbs2"):  # (the shipped run cannot leave: the sweep needs it)
        rest = {n: ov for n, ov in SWEEP.items() if n != left}
        sub = ft.fit_sweep(_write(tmp_path / f"without-{left}", steps, rest))
        pred = _step(SWEEP[left], TimeCalibration(**sub["calibration"]))
        assert rows[left]["leave_one_out_predicted_s"] == pytest.approx(pred, rel=1e-9), left
        assert abs(rows[left]["leave_one_out_predicted_s"] - rows[left]["predicted_s"]) > 1e-6, left
    ship = out["shipped"]
    assert ship["leave_one_out_error"] == rows["shipped"]["leave_one_out_error"]
    assert ship["error"] == rows["shipped"]["error"]


@pytest.mark.parametrize("content, named", [
    ("{", "broken.json"),
    ('{"recipe": "slice-1gpu", "overrides": [], "device": "NVIDIA H200"}', "step_time_mean_s"),
    ('{"recipe": "slice-1gpu", "overrides": "batch.mbs=2", "device": "NVIDIA H200", "step_time_mean_s": 0.7}',
     "overrides"),
    ('[1, 2]', "broken.json"),
])
def test_a_malformed_file_is_named(ft, tmp_path, capsys, content, named):
    folder = _write(tmp_path / "sweep", {"shipped": 0.6, "mbs2": 0.7}, {"shipped": [], "mbs2": ["batch.mbs=2"]})
    (folder / "broken.json").write_text(content)
    out = tmp_path / "fit.json"
    rc = ft.main(["--sweep", str(folder), "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 3 and "broken.json" in err and named in err
    assert not out.exists()
    (folder / "broken.json").unlink()  # the corrected command runs
    assert ft.main(["--sweep", str(folder), "--json", str(out)]) == 0 and json.loads(out.read_text())["runs"] == 2


def test_a_sweep_of_two_machines_or_without_the_shipped_run_is_refused(ft, tmp_path, capsys):
    folder = _write(tmp_path / "a", {"shipped": 0.6, "mbs2": 0.7}, {"shipped": [], "mbs2": ["batch.mbs=2"]})
    run = json.loads((folder / "mbs2.json").read_text())
    (folder / "mbs2.json").write_text(json.dumps({**run, "device": "NVIDIA B200"}))
    assert ft.main(["--sweep", str(folder)]) == 3 and "device" in capsys.readouterr().err
    folder = _write(tmp_path / "b", {"mbs2": 0.7, "mbs8": 0.6}, {"mbs2": ["batch.mbs=2"], "mbs8": ["batch.mbs=8"]})
    assert ft.main(["--sweep", str(folder)]) == 3 and "without overrides" in capsys.readouterr().err
    assert ft.main(["--sweep", str(tmp_path / "missing")]) == 3 and "missing" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["", "2026-12-03", "2026-12-02"], ids=["current", "2026-12-03", "2026-12-02"])
def test_the_committed_sweep_is_the_layout_plansweep_writes(sub):
    """benchmarks/results/plan-sweep/'s files are the layout h200.sh plansweep writes (runs/NAME.json for runs
    above, fingerprint.json beside), each run with the overrides its name stands for, and fit.json fits exactly
    the runs there; the same for the earlier sweeps in 2026-12-03/ (nine runs: its call's limit came before the
    last two) and 2026-12-02/ (all eleven). The READMEs' tables are rendered from fit.json
    (test_benchmarks_rendered.py)."""
    folder = ROOT / "benchmarks" / "results" / "plan-sweep" / sub
    fit = json.loads((folder / "fit.json").read_text())
    ran = {p.stem for p in (folder / "runs").glob("*.json")}
    assert ran <= set(SWEEP) and "shipped" in ran
    for name in ran:
        assert json.loads((folder / "runs" / f"{name}.json").read_text())["overrides"] == SWEEP[name], name
    assert {p["run"] for p in fit["points"]} == ran
    assert fit["sweep"] == f"benchmarks/results/plan-sweep/{sub + '/' if sub else ''}runs"
    assert json.loads((folder / "fingerprint.json").read_text())["kind"] == "muse-stack-fingerprint"
    if ran != set(SWEEP):  # 2026-12-03/: its call's limit came before the last two runs
        assert sub == "2026-12-03" and set(SWEEP) - ran == {"plain-dist-opt", "remainders"}


def test_the_older_runs_fit_recovers_host_and_gpu_terms_across_both_regimes(ft):
    """The default mode's alternation over the linear pieces of max(GPU work, host time): step times
    made by the model at chosen coefficients, on the older runs of benchmarks/ (host-bound proxy runs
    and GPU-bound slice runs at these coefficients), are fitted back to those coefficients from the
    default start."""
    points = ft.runs()
    d = ft.Design(points)
    known = {"matmul_efficiency": 0.5, "elementwise_passes": 5.0, "elementwise_passes_compiled": 2.0,
             "layer_overhead_s": 0.005, "microbatch_overhead_s": 0.01, "expert_overhead_s": 5e-05}
    x = np.array([1 / v if u in ft.INVERSE else v for u, v in known.items()])
    steps = d.step(x)
    # the pieces reproduce the planner's step time at these coefficients
    cal = ft.calibration(dict(zip(ft.UNKNOWNS, x)))
    for j, n in enumerate(d.names):
        assert steps[j] == pytest.approx(ft.step_time(*points[n], cal), rel=REL), n
    assert set(d.regimes(x)) == {"gpu", "host"}
    got, stable = ft.fit_older(d, steps, ft.default_inverse(ft.UNKNOWNS, ft.START))
    assert stable
    # exact data: what is left is float64 rounding amplified by the condition number of the scaled
    # linear piece, ~1e11 (its columns mix seconds and passes): <= ~1e11 x 1.1e-16 ~ 1e-5 relative.
    # 1e-5 still fails on a wrong piece or factor (a percent or more)
    for u, g, want in zip(ft.UNKNOWNS, got, x):
        assert g == pytest.approx(want, rel=1e-5), u


def test_the_plan_against_the_later_sittings_is_the_planners():
    """The plan for slice-1gpu against each side-by-side sitting, priced with the kernels the sitting's runs
    recorded (sittings.py, committed as sittings.json, which the sweep README's table is rendered from): the
    runner's median tokens/s and median step, the plan's, and their errors, row by row; the last sitting ran the
    engine as shipped, so its plan is `muse-stack plan slice-1gpu`'s, and it is within issue 34's 5%."""
    sittings = _module("sittings")
    folder = ROOT / "benchmarks" / "results" / "plan-sweep"
    committed = json.loads((folder / "sittings.json").read_text())
    rows = [sittings.sitting(name) for name in sittings.SITTINGS]
    assert [r["sitting"] for r in committed] == list(sittings.SITTINGS)
    for got, want in zip(committed, rows):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == (pytest.approx(value, rel=REL) if isinstance(value, float) else value), key
    last = rows[-1]
    plan, _ = make_plan(load_recipe("slice-1gpu"), strict=False)
    assert last["shipped_kernels"] and plan.time.step_s == pytest.approx(last["planned_step_s"], rel=REL)
    assert plan.time.tokens_per_s_per_gpu == pytest.approx(last["planned_tokens_per_s_per_gpu"], rel=REL)
    assert abs(last["tokens_per_s_error"]) <= 0.05 and abs(last["step_error"]) <= 0.05
