"""Fit the step-time model's kernel efficiencies to the measured H200 step times (CPU only).

    python benchmarks/scripts/plan/fit_time.py [--json FILE]
    python benchmarks/scripts/plan/fit_time.py --sweep DIR [--json FILE] [--write]

Each fitted point is a megatron-core run of benchmarks/ that measured 30 steps (10 warm-up):
the recipe and overrides it ran with (benchmarks/scripts/plan/fit.py's POINTS and COMPILED, the same
runs the memory calibration uses, less those that measured fewer than 20 steps) and its
``step_time_mean_s``. The unknowns are

    1 / matmul efficiency (dense GEMMs, expert GEMMs, attention), elementwise HBM passes (eager),
    elementwise HBM passes (compiled), and the host times: per layer pass, per micro-batch, per local expert,

beside terms that need no fitting (collectives at datasheet bandwidth, the optimizer step, the
engine's kernels at their measured bandwidth: each run is priced with the kernels it ran, read from
its recorded ``levers`` by ``kernels_of``; the older runs record none and ran the stack's). A
stage's GPU work and its host time are each linear in them, so each unknown's coefficient is read
off the model with that unknown set to 1 and the others to 0. The model (muse_stack/plan/cost.py)
prices a stage's micro-batch at ``max(GPU work, host time)`` (the host's launches run ahead of the
kernels), so the step is piecewise linear: linear where each stage's regime (GPU- or host-bound)
and the slowest stage are fixed (``Design.piece``). The fit alternates (``fit_pieces``): take the
piece the model is on, solve its linear least squares on the relative error with every unknown
non-negative (every subset of free unknowns is solved; the best non-negative one is kept), move to
the solution's piece, until the solution lies on the piece it was solved on; from three starts
(``START``, it with no host time, it with much host time), keeping the lowest residual. The
proxy-model runs (about 5% MFU) are host-bound and fix the host times; the older slice runs are
GPU-bound.

Runs not fitted are checked: the short runs (6 steps, one or two measured: recompute settings,
TP 2 with recompute, the resume runs), the replays of the B200 stack on H200 and the adapter run.
The expected error on an unseen single-GPU variant is the leave-one-out error over the fitted
single-GPU runs: each is predicted by a fit to all the other fitted runs.

With ``--sweep DIR`` the fit takes only the runs of one sweep of one machine (``h200.sh
plansweep``: the shipped ``slice-1gpu`` and each neighbour of its settings): every ``*.json`` of DIR
is an ``engine_steps.py`` result, its recipe (the one the sweep ran) with the ``overrides`` it
records, measured as its ``step_time_mean_s``; the run without overrides is the shipped one. The
unknowns are those above plus the passes of the dispatchers' permutation and of the optimizer
layouts (``SWEEP_UNKNOWNS``), fitted by the same alternation. The host times are not fitted to a
sweep: its runs are GPU-bound (about 50% MFU), where the host time is hidden; they are held at
``PRIOR``, the fit to the older runs above. An unknown the sweep's runs do not separate from the
ones before it (its column is zero on the piece, or a combination of theirs: the sweep is
compiled, so the eager passes are unseen) is held at ``PRIOR`` too and reported as held. Each run
is also predicted by a fit to the others (leave-one-out, the same selection redone on the remaining
runs; an unknown the remaining runs do not separate is held at ``PRIOR`` too, never at a value
fitted with the run left out), and the shipped run's in-sample and leave-one-out errors are
reported apart: the target is within 5%. With ``--write`` the fit's values (fitted and held, to
``datafiles.DIGITS`` significant digits) are written into the planner's calibration,
``muse_stack/plan/calibration.json``, each with the folder it came from (DIR for a fitted one,
benchmarks/results/plan for one held at PRIOR) and this command: the planner's ``TimeCalibration``
defaults are the fit of benchmarks/results/plan-sweep/runs (plan-sweep/fit.json), with PRIOR's host times
and eager passes.

Without ``--sweep``, the runs of benchmarks/ above are also predicted with the planner's
calibration as committed (``TimeCalibration()``; ``adopted_error``): its GPU terms are the sweep's
(other machines and stacks than these runs'), its host times this fit's. ``adopted_leave_one_out_error``
redoes the whole calibration without each fitted run (this fit without it, then the sweep's fit
holding that fit's values) and predicts the run: out of sample. The checked runs are in no fit.

Nothing here reads the B200 record.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datafiles  # noqa: E402
from fit import COMPILED, POINTS, SLICE_AS_MEASURED  # noqa: E402

from muse_stack.util.errors import InputError, MuseStackError  # noqa: E402
from muse_stack.plan.cost import StepKernels, TimeCalibration, step_kernels  # noqa: E402
from muse_stack.plan.planner import make_plan  # noqa: E402
from muse_stack.recipes.catalogue import load_recipe  # noqa: E402
from muse_stack.recipes.schema import Recipe  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "results"
#: the sweep the committed calibration is fitted to
SWEEP_RUNS = BENCH / "plan-sweep" / "runs"
#: unknown -> the TimeCalibration fields it sets. Dense GEMMs, expert GEMMs and attention share one
#: efficiency: fitted apart they are not identified by these runs (the fit sends two of them to
#: infinity and moves their time into the others), so only the roofline tells their shapes apart.
UNKNOWNS: dict[str, list[str]] = {
    "matmul_efficiency": ["gemm_efficiency_dense", "gemm_efficiency_expert", "attention_efficiency"],
    "elementwise_passes": ["elementwise_passes"],
    "elementwise_passes_compiled": ["elementwise_passes_compiled"],
    "layer_overhead_s": ["layer_overhead_s"],
    "microbatch_overhead_s": ["microbatch_overhead_s"],
    "expert_overhead_s": ["expert_overhead_s"],
}
INVERSE = {"matmul_efficiency"}
#: the unknowns of a sweep (``--sweep``), in the order they join the fit: an unknown the sweep does
#: not separate from those before it is held at its default. The sweep is compiled (eager passes
#: unseen) and holds the expert count (the time per local expert moves with the time per layer).
SWEEP_UNKNOWNS: dict[str, list[str]] = {
    "matmul_efficiency": UNKNOWNS["matmul_efficiency"],
    "elementwise_passes_compiled": ["elementwise_passes_compiled"],
    "layer_overhead_s": ["layer_overhead_s"],
    "microbatch_overhead_s": ["microbatch_overhead_s"],
    "dispatch_passes_allgather": ["dispatch_passes_allgather"],
    "dispatch_passes_alltoall": ["dispatch_passes_alltoall"],
    "optimizer_copy_passes": ["optimizer_copy_passes"],
    "remainder_passes": ["remainder_passes"],
    "elementwise_passes": ["elementwise_passes"],
    "expert_overhead_s": ["expert_overhead_s"],
}
#: where the default mode's alternation starts (with two more starts, see ``starts``): the
#: calibration that summed host and GPU time, fitted to the runs of benchmarks/ below (TimeCalibration's
#: defaults at commit 24fb9f4); a start only, no value of it is kept
START = TimeCalibration(gemm_efficiency_dense=0.7246, gemm_efficiency_expert=0.7246, attention_efficiency=0.7246,
                        elementwise_passes=5.879, elementwise_passes_compiled=0.0, layer_overhead_s=0.006226,
                        microbatch_overhead_s=0.0, expert_overhead_s=7.833e-05, dispatch_passes_allgather=0.0,
                        dispatch_passes_alltoall=0.0, optimizer_copy_passes=0.0, remainder_passes=0.0)
#: the fit to the older runs of benchmarks/ below, as committed (this script without --sweep writes it)
PRIOR_FIT = BENCH / "plan" / "fit_time.json"


def older_fit(path: Path = PRIOR_FIT) -> TimeCalibration:
    """The fit to the older runs (``path``'s ``fitted``, to ``datafiles.DIGITS`` significant digits, as the
    calibration is written), host time overlapping the GPU work; the dispatch and optimizer-layout passes
    unfitted (0)."""
    try:
        fitted = json.loads(path.read_text())["fitted"]
        values = {u: datafiles.significant(fitted[u]) for u in UNKNOWNS}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: no fit to the older runs ({e!r}); run this script without --sweep "
                         f"--json {datafiles.rel(path)}") from None
    fields = {f: values[u] for u, fs in UNKNOWNS.items() for f in fs}
    return TimeCalibration(**fields, **{f: 0.0 for u, fs in SWEEP_UNKNOWNS.items() if u not in UNKNOWNS for f in fs})


#: the older runs' fit (other machines and stacks than the sweep's). A sweep holds at these what its runs (or,
#: left out, the remaining runs) do not separate: the host times, which a GPU-bound sweep hides, and the
#: eager passes
PRIOR = older_fit()
#: fields only a sweep fits (the default mode holds them at their defaults and does not list them)
SWEEP_ONLY = [f for u, fs in SWEEP_UNKNOWNS.items() if u not in UNKNOWNS for f in fs]
#: a column (in relative-error units) joins the sweep's fit when its part outside the span of the
#: columns already in is at least this share of its length. Step times of one machine scatter about
#: 0.5% (issue 34: CV 0.4-0.6% with the collector off); a column less than 1% apart from the others
#: would take its value from that scatter. Exact collinearity leaves ~1e-16.
IDENTIFIED = 1e-2
#: the sweep's lower bound of each unknown as the model is linear in it (others: 0): an efficiency
#: is at most 1, no kernel beats the datasheet's peak or HBM bandwidth the roofline prices
SWEEP_LOWER = {"matmul_efficiency": 1.0}
#: the shipped run must be predicted within this (issue 34)
TARGET = 0.05
#: a value that makes an efficiency's term vanish (its inverse is ~0) without dividing by zero
HUGE = 1e30

#: runs that measured fewer than 20 steps or replay another stack: checked, not fitted
CHECKS: dict[str, tuple[str, list[str]]] = {
    "recompute/none": ("proxy-1gpu", []),
    "recompute/full": ("proxy-1gpu", ["recompute.granularity=full"]),
    "recompute/core-attn": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[core_attn]"]),
    "recompute/moe-act": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[moe_act]"]),
    "recompute/moe": ("proxy-1gpu", ["recompute.granularity=selective", "recompute.modules=[moe]"]),
    "tp2-recompute": ("proxy-2gpu", ["layout.ep=1", "layout.tp=2", "recompute.granularity=full"]),
    "resume/ep2-full": ("proxy-2gpu", []),
    "resume/pp2-full": ("proxy-2gpu", ["layout.ep=1", "layout.pp=2", "layout.pp_layers=[1,3]"]),
    "replay-h200": ("slice-1gpu", SLICE_AS_MEASURED),
    "replay-b200": ("slice-1gpu", SLICE_AS_MEASURED),
    # adapters on a frozen base (lora-64's peft block on the slice, `h200.sh peftrun`; 20 steps, 10 measured)
    "peft-lora-slice/full": ("slice-1gpu", [
        *SLICE_AS_MEASURED, "peft.scheme=lora", "peft.rank=32", "peft.alpha=32", "peft.dropout=0.0", "peft.per_expert=true",
        "peft.targets=[self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,mlp.experts.gate_up_proj,"
        "mlp.experts.down_proj,mlp.pre_expert_proj,mlp.post_expert_proj]", "frozen=[base]"]),
}


def runs() -> dict[str, tuple[str, list[str], None]]:
    """The fitted older runs: (recipe, overrides, levers) with no levers recorded (see ``kernels_of``)."""
    fitted = {**POINTS, **COMPILED}
    return {n: (*v, None) for n, v in fitted.items() if n not in CHECKS}


def checks() -> dict[str, tuple[str, list[str], None]]:
    """The checked older runs, as ``runs``."""
    return {n: (*v, None) for n, v in CHECKS.items()}


#: what each ``levers`` entry of an engine_steps.py result reads for each kernel the planner prices
#: (``muse_stack/engines/megatron.py``, ``levers``)
RECORDED = {"adam_step": {"one Triton launch": "triton", "Transformer Engine's multi_tensor_adam": "te"},
            "embedding_grad": {"each token's gradient added into the fp32 main gradient": "main_grad",
                               "a dense bf16 gradient": "dense"},
            "post_expert_norm_backward": {"one Triton pass": "one_pass", "the compiled chain's": "compiled"}}


def kernels_of(recipe: Recipe, levers: dict | None) -> StepKernels:
    """The kernels a run ran, from its recorded ``levers``. An entry the run does not record predates
    the engine's own kernel (the older runs of benchmarks/ record no levers; the sweep of 3 Dec no
    ``adam_step`` or ``embedding_grad``): TE's Adam update, megatron-core's dense embedding gradient
    (none where the table is frozen), the compiled chain's norm backward."""
    levers = levers or {}
    found = {}
    for key, kinds in RECORDED.items():
        text = levers.get(key)
        if text is None:
            continue
        kind = next((k for prefix, k in kinds.items() if str(text).startswith(prefix)), None)
        if kind is None:
            raise InputError(f"levers.{key} reads {text!r}, which names no kernel the planner prices", field=key,
                             value=text, fix=f"one of: {', '.join(kinds)} (muse_stack/engines/megatron.py)")
        found[key] = kind
    frozen = step_kernels(recipe).embedding_grad == "frozen"  # no gradient at all, whichever engine
    return StepKernels(adam=found.get("adam_step", "te"),
                       embedding_grad="frozen" if frozen else found.get("embedding_grad", "dense"),
                       post_expert_norm_backward=found.get("post_expert_norm_backward", "compiled"))


def results(folder: str) -> dict:
    return json.loads((BENCH / folder / "results.json").read_text())


def step_time(name: str, overrides: list[str], levers: dict | None, cal: TimeCalibration) -> float:
    recipe = load_recipe(name, overrides)
    plan, _ = make_plan(recipe, strict=False, time_calibration=cal, kernels=kernels_of(recipe, levers))
    assert plan.time is not None, (name, overrides, plan.time_unavailable)
    return plan.time.step_s


def parts(name: str, overrides: list[str], levers: dict | None,
          cal: TimeCalibration) -> tuple[np.ndarray, np.ndarray, float, int, int]:
    """(GPU work per stage, host time per stage (per micro-batch), the time after the pipeline (DP
    collectives and the optimizer), micro-batches, virtual stages) of one run's plan, priced with the
    kernels it ran (``levers``: its record, ``kernels_of``)."""
    recipe = load_recipe(name, overrides)
    plan, _ = make_plan(recipe, strict=False, time_calibration=cal, kernels=kernels_of(recipe, levers))
    t = plan.time
    assert t is not None, (name, overrides, plan.time_unavailable)
    return (np.array(t.stage_gpu_s), np.array(t.stage_host_s), t.terms_s["dp_comm"] + t.terms_s["optimizer"],
            t.microbatches, recipe.layout.vpp or 1)


def calibration(values: dict[str, float], unknowns: dict[str, list[str]] = UNKNOWNS) -> TimeCalibration:
    """``values``: each unknown as the model is linear in it (efficiencies inverted)."""
    fields = {}
    for k, v in values.items():
        for f in unknowns[k]:
            fields[f] = (1 / v if v > 0 else HUGE) if k in INVERSE else v
    return TimeCalibration(**fields)


class Design:
    """The step-time model of each run as a function of the unknowns ``x`` (as the model is linear
    in them). A stage's GPU work and its host time are each linear in ``x`` (read off the model
    with each unknown at 1 and the others at 0); a stage costs ``max(GPU work, host time)`` per
    micro-batch (muse_stack/plan/cost.py: the host's launches run ahead of the kernels), the 1F1B
    pipeline ``(m - 1) x max over stages + sum over stages / VPP``, then the DP collectives and the
    optimizer (linear). So the step is piecewise linear in ``x``: linear where each stage's regime
    (GPU- or host-bound) and the slowest stage are fixed (``piece``)."""

    def __init__(self, points: dict[str, tuple[str, list[str], dict | None]],
                 unknowns: dict[str, list[str]] = UNKNOWNS):
        zero = {u: 0.0 for u in unknowns}
        base = [parts(*points[n], calibration(zero, unknowns)) for n in points]
        ones = [[parts(*points[n], calibration({**zero, u: 1.0}, unknowns)) for n in points] for u in unknowns]
        self.names = list(points)
        self.gpu0 = [b[0] for b in base]
        self.host0 = [b[1] for b in base]
        self.out0 = np.array([b[2] for b in base])
        self.m = np.array([b[3] for b in base], dtype=float)
        self.vpp = np.array([b[4] for b in base], dtype=float)
        # [run] -> [stage, unknown]
        self.gpu = [np.stack([ones[u][r][0] - base[r][0] for u in range(len(unknowns))], axis=1)
                    for r in range(len(base))]
        self.host = [np.stack([ones[u][r][1] - base[r][1] for u in range(len(unknowns))], axis=1)
                     for r in range(len(base))]
        self.out = np.stack([np.array([ones[u][r][2] - base[r][2] for r in range(len(base))])
                             for u in range(len(unknowns))], axis=1)

    def subset(self, keep: np.ndarray) -> Design:
        d = object.__new__(Design)
        idx = np.flatnonzero(keep)
        d.names = [self.names[i] for i in idx]
        for f in ("gpu0", "host0", "gpu", "host"):
            setattr(d, f, [getattr(self, f)[i] for i in idx])
        for f in ("out0", "m", "vpp", "out"):
            setattr(d, f, getattr(self, f)[idx])
        return d

    def piece(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple]:
        """(coefficients [run, unknown], the time that needs no unknown [run], the piece) of the
        linear piece the model is on at ``x``: per run, each stage's regime (GPU-bound where its GPU
        work is at least its host time) and the slowest stage."""
        rows, consts, key = [], [], []
        for r in range(len(self.names)):
            g = self.gpu[r] @ x + self.gpu0[r]
            h = self.host[r] @ x + self.host0[r]
            gpu_bound = g >= h
            coef = np.where(gpu_bound[:, None], self.gpu[r], self.host[r])
            const = np.where(gpu_bound, self.gpu0[r], self.host0[r])
            slow = int(np.argmax(np.maximum(g, h)))
            m, vpp = self.m[r], self.vpp[r]
            rows.append((m - 1) * coef[slow] + coef.sum(axis=0) / vpp + self.out[r])
            consts.append((m - 1) * const[slow] + const.sum() / vpp + self.out0[r])
            key.append((tuple(bool(b) for b in gpu_bound), slow))
        return np.array(rows), np.array(consts), tuple(key)

    def step(self, x: np.ndarray) -> np.ndarray:
        a, b, _ = self.piece(x)
        return a @ x + b

    def regimes(self, x: np.ndarray) -> list[str]:
        """Per run: "gpu" where the GPU work of its slowest stage is at least its host time, else "host"."""
        out = []
        for r in range(len(self.names)):
            g = self.gpu[r] @ x + self.gpu0[r]
            h = self.host[r] @ x + self.host0[r]
            slow = int(np.argmax(np.maximum(g, h)))
            out.append("gpu" if g[slow] >= h[slow] else "host")
        return out


#: the most linear solves of one alternation (a piece seen again ends it)
MAX_PIECES = 50


def fit_pieces(d: Design, measured: np.ndarray, solve_piece, starts: list[np.ndarray]):
    """Least squares on the relative error of the piecewise-linear model, by alternation: from each
    start, take the linear piece the model is on, solve that linear problem (``solve_piece(a, b)``
    -> (x, info)), move to the solution's piece, and repeat until the solution lies on the piece it
    was solved on (stable) or a piece comes back. Returns (x, info, stable) of the lowest true
    residual over every solution visited from every start."""
    best = None
    for x in starts:
        seen = set()
        for _ in range(MAX_PIECES):
            a, b, key = d.piece(x)
            if key in seen:
                break
            seen.add(key)
            x_new, info = solve_piece(a, b)
            res = float((((d.step(x_new) - measured) / measured) ** 2).sum())
            stable = d.piece(x_new)[2] == key
            if best is None or res < best[0] - 1e-15:
                best = (res, x_new, info, stable)
            x = x_new
            if stable:
                break
    return best[1], best[2], best[3]


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every unknown >= 0, by solving each subset of free unknowns."""
    best, best_res = np.zeros(a.shape[1]), float(y @ y)
    for r in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
            if (x < 0).any():
                continue
            res = float(((a[:, free] @ x - y) ** 2).sum())
            if res < best_res:
                best_res, best = res, np.zeros(a.shape[1])
                best[list(free)] = x
    return best


def solve(a: np.ndarray, base: np.ndarray, measured: np.ndarray) -> np.ndarray:
    # relative error: divide each run's equation by its measured time
    return nnls(a / measured[:, None], (measured - base) / measured)


#: the host unknowns: the fixed times the host spends launching (cost.py's host time)
HOST = ("layer_overhead_s", "microbatch_overhead_s", "expert_overhead_s")
#: what the committed sweep holds at PRIOR: the host times and the eager passes (it is compiled)
HELD_BY_SWEEP = (*HOST, "elementwise_passes")


def starts(unknowns: dict[str, list[str]], x0: np.ndarray) -> list[np.ndarray]:
    """The alternation's starting points: ``x0``, ``x0`` with no host time (every run GPU-bound),
    and ``x0`` with 100 x its host time or 10 ms per host unknown (every run host-bound)."""
    keys = list(unknowns)
    host = np.array([k in HOST for k in keys])
    none_ = np.where(host, 0.0, x0)
    high = np.where(host, np.maximum(100 * x0, 1e-2), x0)
    return [x0, none_, high]


def fit_older(d: Design, measured: np.ndarray, x0: np.ndarray) -> tuple[np.ndarray, bool]:
    """The default mode's fit: every unknown of UNKNOWNS non-negative, by alternation over the pieces."""
    x, _, stable = fit_pieces(d, measured, lambda a, b: (solve(a, b, measured), None), starts(UNKNOWNS, x0))
    return x, stable


def to_values(x: np.ndarray) -> dict[str, float]:
    return {u: (1 / v if v > 0 else float("inf")) if u in INVERSE else float(v) for u, v in zip(UNKNOWNS, x)}


def check_prior(values: dict[str, float]) -> list[str]:
    """Fields of PRIOR (the committed fit_time.json, rounded) that differ from this fit to the older runs by
    more than that rounding: the file to commit, and the sweep to refit (``--sweep DIR --write``)."""
    return [f for u, v in values.items() for f in UNKNOWNS[u]
            if np.isfinite(v) and abs(getattr(PRIOR, f) - v) > max(5e-4 * abs(v), 1e-12)]


def check_defaults(values: dict[str, float]) -> list[str]:
    """Fields of TimeCalibration() that a sweep holds (the host times, the eager passes) and that differ
    from this fit by more than its printed rounding; the others are the sweep's."""
    cur = TimeCalibration()
    return [f for u, v in values.items() if u in HELD_BY_SWEEP for f in UNKNOWNS[u]
            if abs(getattr(cur, f) - v) > max(5e-4 * abs(v), 1e-12)]


def family(points: dict[str, tuple], name: str) -> str:
    """The model a run trains: "proxy" (proxy-1gpu / proxy-2gpu: 4 layers, hidden 2,048, 64 experts)
    or "slice" (slice-1gpu: 2 layers, hidden 8,192, 32 experts)."""
    return "proxy" if points[name][0].startswith("proxy") else "slice"


def fit(sweep: Path | None = None) -> dict:
    """The fit to the older runs (``fitted``, with its leave-one-out errors over the single-GPU runs)
    and the planner's calibration as committed checked on them (``adopted``). ``sweep``: the folder
    of the sweep the committed calibration was fitted to (default plan-sweep/runs): each fitted
    run's ``adopted_leave_one_out_error`` is the whole calibration redone without it, the older-run
    fit without the run and then the sweep's fit holding that fit's values where it held PRIOR's."""
    points = runs()
    names = list(points)
    d = Design(points)
    measured = np.array([results(n)["step_time_mean_s"] for n in names])
    x0 = default_inverse(UNKNOWNS, START)
    x, stable = fit_older(d, measured, x0)
    values = to_values(x)
    cal = calibration({u: float(v) for u, v in zip(UNKNOWNS, x)})
    pred_all = d.step(x)
    regime = d.regimes(x)
    # leave one out over the single-GPU runs
    loo = {}
    for j, n in enumerate(names):
        if results(n)["world_size"] != 1:
            continue
        keep = np.arange(len(names)) != j
        xj, _ = fit_older(d.subset(keep), measured[keep], x0)
        loo[n] = float(d.step(xj)[j] / measured[j] - 1)
    # the planner's calibration as committed (the sweep's GPU terms, the host terms held at PRIOR)
    adopted = TimeCalibration()
    # the same calibration redone without each fitted run: its older-run fit, then the sweep's fit
    # holding that fit's values where the sweep holds PRIOR's
    sweep = sweep or SWEEP_RUNS
    recipe, sw, _ = load_sweep(sweep)
    sw_names = sorted(sw, key=lambda n: (bool(sw[n][0]), n))
    sd = Design({n: (recipe, sw[n][0], sw[n][2]) for n in sw_names}, SWEEP_UNKNOWNS)
    sm = np.array([sw[n][1] for n in sw_names])
    adopted_loo = {}
    for j, n in enumerate(names):
        keep = np.arange(len(names)) != j
        xj, _ = fit_older(d.subset(keep), measured[keep], x0)
        prior_j = PRIOR.model_copy(update=calibration({u: float(v) for u, v in zip(UNKNOWNS, xj)}).model_dump(
            include={f for fs in UNKNOWNS.values() for f in fs}))
        held_j = default_inverse(SWEEP_UNKNOWNS, prior_j)
        xs, _, _ = sweep_fit(sd, sm, held_j)
        cal_j = calibration({u: float(v) for u, v in zip(SWEEP_UNKNOWNS, xs)}, SWEEP_UNKNOWNS)
        adopted_loo[n] = step_time(*points[n], cal_j) / measured[j] - 1
    table = []
    for j, n in enumerate(names):
        pred = float(pred_all[j])
        ad = step_time(*points[n], adopted)
        table.append({"benchmark": n, "set": "fitted", "family": family(points, n), "gpus": results(n)["world_size"],
                      "measured_s": float(measured[j]), "predicted_s": pred, "error": pred / measured[j] - 1,
                      "regime": regime[j], "leave_one_out_error": loo.get(n),
                      "adopted_predicted_s": ad, "adopted_error": ad / measured[j] - 1,
                      "adopted_leave_one_out_error": float(adopted_loo[n])})
    checked = checks()
    check_regime = Design(checked).regimes(x)
    for (n, point), reg in zip(checked.items(), check_regime):
        r = results(n)
        pred = step_time(*point, cal)
        ad = step_time(*point, adopted)
        table.append({"benchmark": n, "set": "checked", "family": family(CHECKS, n), "gpus": r["world_size"],
                      "measured_s": r["step_time_mean_s"], "predicted_s": pred, "error": pred / r["step_time_mean_s"] - 1,
                      "regime": reg, "leave_one_out_error": None,
                      "adopted_predicted_s": ad, "adopted_error": ad / r["step_time_mean_s"] - 1,
                      "adopted_leave_one_out_error": None})
    loo_abs = [abs(v) for v in loo.values()]

    def summary(rows: list[dict], key: str = "adopted_error") -> dict:
        errs = [abs(r[key]) for r in rows]
        return {"runs": len(rows), "mean_abs_error": float(np.mean(errs)), "max_abs_error": float(np.max(errs)),
                "mean_error": float(np.mean([r[key] for r in rows]))}

    fitted_rows = [r for r in table if r["set"] == "fitted"]
    checked_rows = [r for r in table if r["set"] == "checked"]
    groups = {"fitted_single_gpu": [r for r in fitted_rows if r["gpus"] == 1], "fitted_all": fitted_rows,
              "checked": checked_rows}
    for fam in ("proxy", "slice"):
        groups[f"{fam}_fitted"] = [r for r in fitted_rows if r["family"] == fam]
        groups[f"{fam}_checked"] = [r for r in checked_rows if r["family"] == fam]
    return {"fitted": values, "inverse_fitted": dict(zip(UNKNOWNS, map(float, x))), "stable": stable,
            "leave_one_out_single_gpu_mean_abs_error": float(np.mean(loo_abs)) if loo_abs else None,
            "leave_one_out_single_gpu_max_abs_error": float(np.max(loo_abs)) if loo_abs else None,
            "adopted": {"source": adopted.source, **{k: summary(v) for k, v in groups.items()}},
            "adopted_leave_one_out": {k: summary(groups[k], "adopted_leave_one_out_error")
                                      for k in ("fitted_single_gpu", "fitted_all", "proxy_fitted", "slice_fitted")},
            "current": adopted.model_dump(exclude=set(SWEEP_ONLY)), "defaults_differ": check_defaults(values),
            "prior_differs": check_prior(values), "points": table}


# ---- --sweep: one machine's runs of the shipped recipe and its neighbours ------------------------

def _field(path: Path, run: dict, key: str, ok, want: str):
    if key not in run or not ok(run[key]):
        raise InputError(f"{path}: {key} is {'missing' if key not in run else 'not ' + want}", field=key,
                         value=run.get(key), fix=f"give each file of the sweep {key} ({want}), as engine_steps.py "
                                                 "writes it, or remove the file from the folder")
    return run[key]


def load_sweep(folder: Path) -> tuple[str, dict[str, tuple[list[str], float, dict | None]], str]:
    """(recipe, {run: (overrides, measured step s, recorded levers)}, device) of every ``*.json`` in
    ``folder``; InputError naming the file for one that is not an engine_steps.py result."""
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder", field="--sweep", value=str(folder),
                         fix="give the folder h200.sh plansweep wrote ($OUT/plan-sweep)")
    files = sorted(folder.glob("*.json"))
    if len(files) < 2:
        raise InputError(f"{folder} holds {len(files)} .json file(s); a fit needs the shipped run and neighbours",
                         field="--sweep", value=str(folder), fix="give the folder h200.sh plansweep wrote")
    recipes, devices, runs_ = {}, {}, {}
    for path in files:
        try:
            run = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{path}: not readable JSON ({e})", field="--sweep", value=str(path),
                             fix="rerun its step of h200.sh plansweep, or remove the file from the folder") from None
        if not isinstance(run, dict):
            raise InputError(f"{path}: not a JSON object", field="--sweep", value=str(path),
                             fix="give engine_steps.py results only")
        recipes[path] = _field(path, run, "recipe", lambda v: isinstance(v, str) and v, "a recipe name")
        devices[path] = _field(path, run, "device", lambda v: isinstance(v, str) and v, "a device name")
        overrides = _field(path, run, "overrides", lambda v: isinstance(v, list) and all(isinstance(o, str) for o in v),
                           "a list of key=value strings")
        measured = _field(path, run, "step_time_mean_s", lambda v: isinstance(v, (int, float))
                          and not isinstance(v, bool) and np.isfinite(v) and v > 0, "a positive number of seconds")
        levers = run.get("levers")
        if levers is not None and not isinstance(levers, dict):
            raise InputError(f"{path}: levers is not an object", field="levers", value=levers,
                             fix="give engine_steps.py results only")
        runs_[path.stem] = (list(overrides), float(measured), levers)
    for what, seen in (("recipe", recipes), ("device", devices)):
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{p.name}: {v}" for p, v in seen.items())
            raise InputError(f"the sweep's runs name more than one {what} ({listed}); a refit takes one recipe's "
                             "runs from one machine", field=what, value=sorted(set(seen.values())),
                             fix="keep the runs of one h200.sh plansweep call in the folder")
    shipped = [n for n, (ov, _, _) in runs_.items() if not ov]
    if len(shipped) != 1:
        raise InputError(f"{folder}: {len(shipped)} runs without overrides ({', '.join(shipped) or 'none'}); the "
                         "sweep needs exactly one run of the recipe as shipped", field="overrides",
                         value=shipped, fix="keep one shipped run (h200.sh plansweep: shipped.json)")
    recipe = next(iter(recipes.values()))
    for name, (ov, _, levers) in runs_.items():
        try:
            kernels_of(load_recipe(recipe, ov), levers)
        except MuseStackError as e:
            raise InputError(f"{folder / (name + '.json')}: its overrides do not apply to {recipe}: {e.message}",
                             field="overrides", value=ov, fix="run the fit at the commit the sweep ran") from None
    return recipe, runs_, next(iter(devices.values()))


def identified(a: np.ndarray, measured: np.ndarray, skip: tuple[int, ...] = ()) -> list[int]:
    """Indices of the unknowns the runs separate, in order: a column joins unless it is in ``skip``,
    zero or (to ``IDENTIFIED``) a combination of the columns already in."""
    rel = a / measured[:, None]
    keep: list[int] = []
    for j in range(rel.shape[1]):
        if j in skip:
            continue
        col = rel[:, j]
        length = float(np.linalg.norm(col))
        if length == 0:
            continue
        if keep:
            q, _ = np.linalg.qr(rel[:, keep])
            col = col - q @ (q.T @ col)
        if np.linalg.norm(col) >= IDENTIFIED * length:
            keep.append(j)
    return keep


def default_inverse(unknowns: dict[str, list[str]], cur: TimeCalibration = PRIOR) -> np.ndarray:
    """Each unknown at its value in ``cur`` (the calibration before the sweep), as the model is linear in it."""
    vals = []
    for u, fields in unknowns.items():
        v = getattr(cur, fields[0])
        vals.append((1 / v if v > 0 else 0.0) if u in INVERSE else v)
    return np.array(vals)


def sweep_fit(d: Design, measured: np.ndarray, held_x: np.ndarray) -> tuple[np.ndarray, list[int], bool]:
    """(every unknown as the model is linear in it, the indices fitted, stable): ``solve_sweep`` on
    the linear pieces of the model, by alternation (``fit_pieces``), from ``held_x`` and from it
    with no host time and with much host time."""
    return fit_pieces(d, measured, lambda a, b: solve_sweep(a, b, measured, held_x), starts(SWEEP_UNKNOWNS, held_x))


def solve_sweep(a: np.ndarray, base: np.ndarray, measured: np.ndarray, held_x: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(every unknown as the model is linear in it, the indices fitted): the identified unknowns by
    least squares on the relative error, each at or above its ``SWEEP_LOWER`` bound, the others at
    ``held_x``."""
    # the host times are the older runs' (PRIOR): the sweep's runs are GPU-bound (about 50% MFU), and
    # a step that only hides host time says little of it (a host time fitted to them could as well
    # explain the sweep as host-bound, at a plateau its GEMMs do not show)
    free = identified(a, measured, skip=tuple(j for j, u in enumerate(SWEEP_UNKNOWNS) if u in HOST))
    held = [j for j in range(a.shape[1]) if j not in free]
    lower = np.array([SWEEP_LOWER.get(u, 0.0) for u in SWEEP_UNKNOWNS])[free]
    x = held_x.copy()
    rest = base + a[:, held] @ held_x[held] + a[:, free] @ lower
    x[free] = lower + solve(a[:, free], rest, measured)
    return x, free


def fit_sweep(folder: Path, prior: TimeCalibration | None = None) -> dict:
    """The sweep's fit; ``prior`` (default PRIOR): the values held where the runs do not separate an unknown."""
    prior = prior or PRIOR
    recipe, sweep, device = load_sweep(folder)
    names = sorted(sweep, key=lambda n: (bool(sweep[n][0]), n))  # the shipped run first
    points = {n: (recipe, sweep[n][0], sweep[n][2]) for n in names}
    unknowns = SWEEP_UNKNOWNS
    d = Design(points, unknowns)
    measured = np.array([sweep[n][1] for n in names])
    held_x = default_inverse(unknowns, prior)
    x, free, stable = sweep_fit(d, measured, held_x)
    keys = list(unknowns)
    pred_all = d.step(x)
    regime = d.regimes(x)
    table = []
    for j, n in enumerate(names):
        keep = np.arange(len(names)) != j
        xj, free_j, _ = sweep_fit(d.subset(keep), measured[keep], held_x)
        pred = float(pred_all[j])
        loo = float(d.step(xj)[j])
        table.append({"run": n, "overrides": sweep[n][0], "measured_s": float(measured[j]), "predicted_s": pred,
                      "error": pred / measured[j] - 1, "regime": regime[j], "leave_one_out_predicted_s": loo,
                      "leave_one_out_error": loo / measured[j] - 1,
                      "leave_one_out_held": [keys[i] for i in range(len(keys)) if i not in free_j]})
    ship = next(r for r in table if not r["overrides"])
    values = {u: (1 / v if v > 0 else float("inf")) if u in INVERSE else float(v) for u, v in zip(keys, x)}
    cal = calibration({u: float(v) for u, v in zip(keys, x)}, unknowns)
    cur = TimeCalibration()
    differ = [f for u, v in values.items() for f in unknowns[u] if abs(getattr(cur, f) - v) > 5e-4 * max(1.0, abs(v))]
    loo_abs = [abs(r["leave_one_out_error"]) for r in table]
    return {"sweep": str(folder), "recipe": recipe, "device": device, "runs": len(names), "stable": stable,
            "fitted": {keys[i]: values[keys[i]] for i in free},
            "held": {keys[i]: values[keys[i]] for i in range(len(keys)) if i not in free},
            "inverse_fitted": dict(zip(keys, map(float, x))), "calibration": cal.model_dump(),
            "shipped": {"run": ship["run"], "measured_s": ship["measured_s"], "predicted_s": ship["predicted_s"],
                        "error": ship["error"], "leave_one_out_error": ship["leave_one_out_error"],
                        "target": TARGET, "within_target": bool(abs(ship["error"]) <= TARGET),
                        "leave_one_out_within_target": bool(abs(ship["leave_one_out_error"]) <= TARGET)},
            "leave_one_out_mean_abs_error": float(np.mean(loo_abs)),
            "leave_one_out_max_abs_error": float(np.max(loo_abs)),
            "current": cur.model_dump(), "defaults_differ": differ, "points": table}


def print_sweep(out: dict) -> None:
    print(f"sweep {out['sweep']}: {out['runs']} runs of {out['recipe']} on {out['device']}")
    print("fit: " + ", ".join(f"{k} {v:.4g}" for k, v in out["fitted"].items()))
    if out["held"]:
        print("held at their values before the sweep (PRIOR; not separated by the sweep): "
              + ", ".join(f"{k} {v:.4g}" for k, v in out["held"].items()))
    print(f"{'run':24} {'measured s':>10} {'model s':>8} {'error':>7} {'LOO s':>8} {'LOO':>7}  overrides")
    for r in out["points"]:
        print(f"{r['run']:24} {r['measured_s']:10.3f} {r['predicted_s']:8.3f} {r['error']:+7.1%} "
              f"{r['leave_one_out_predicted_s']:8.3f} {r['leave_one_out_error']:+7.1%}  {' '.join(r['overrides'])}")
    s = out["shipped"]
    print(f"shipped ({s['run']}): measured {s['measured_s']:.3f} s, model {s['predicted_s']:.3f} s, error "
          f"{s['error']:+.1%} in sample, {s['leave_one_out_error']:+.1%} left out (target within {s['target']:.0%}: "
          f"{'met' if s['within_target'] else 'missed'} in sample, "
          f"{'met' if s['leave_one_out_within_target'] else 'missed'} left out)")
    print(f"leave-one-out error over the sweep: mean {out['leave_one_out_mean_abs_error']:.1%}, "
          f"max {out['leave_one_out_max_abs_error']:.1%}")
    if out["defaults_differ"]:
        print(f"TimeCalibration defaults differ from this fit: {', '.join(out['defaults_differ'])}")


def write_calibration(out: dict, folder: Path, json_out: Path | None,
                      path: Path = datafiles.CALIBRATION) -> str:
    """Write a sweep's fit (``out``, of ``folder``; ``json_out``: where its JSON went) into the planner's
    calibration: every field of SWEEP_UNKNOWNS, a fitted one from ``folder``, a held one from PRIOR's
    (benchmarks/results/plan), each with this command. Returns the file's text."""
    cmd = datafiles.command(__file__, "--sweep", folder, *(("--json", json_out) if json_out else ()), "--write")
    held = {f for u in out["held"] for f in SWEEP_UNKNOWNS[u]}
    entries = {f: datafiles.entry(datafiles.significant(out["calibration"][f]),
                                  PRIOR_FIT.parent if f in held else folder, cmd)
               for fields in SWEEP_UNKNOWNS.values() for f in fields}
    return datafiles.write_calibration({"time": entries}, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--sweep", type=Path, help="a folder of engine_steps.py results of one machine (h200.sh plansweep)")
    ap.add_argument("--write", action="store_true",
                    help="with --sweep: write the fit into muse_stack/plan/calibration.json")
    args = ap.parse_args(argv)
    if args.write and args.sweep is None:
        ap.error("--write takes a sweep's fit (--sweep DIR): the older runs' fit reaches the planner as the values "
                 "a sweep holds (PRIOR, read from benchmarks/results/plan/fit_time.json)")
    if args.sweep is not None:
        try:
            out = fit_sweep(args.sweep)
        except MuseStackError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        print_sweep(out)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
        if args.write:
            write_calibration(out, args.sweep, args.json)
            print(f"written to {datafiles.rel(datafiles.CALIBRATION)}")
        return 0
    out = fit()
    print("fit: " + ", ".join(f"{k} {v:.4g}" for k, v in out["fitted"].items()))
    print(f"leave-one-out error on single-GPU runs: mean {out['leave_one_out_single_gpu_mean_abs_error']:.1%}, "
          f"max {out['leave_one_out_single_gpu_max_abs_error']:.1%}")
    print(f"{'benchmark':24} {'set':8} {'GPUs':>4} {'regime':>6} {'measured s':>10} {'model s':>8} {'error':>7} "
          f"{'LOO':>7} {'planner s':>9} {'planner':>7} {'left out':>8}")
    for r in out["points"]:
        loo = f"{r['leave_one_out_error']:+7.1%}" if r["leave_one_out_error"] is not None else ""
        ad_loo = f"{r['adopted_leave_one_out_error']:+8.1%}" if r["adopted_leave_one_out_error"] is not None else ""
        print(f"{r['benchmark']:24} {r['set']:8} {r['gpus']:4} {r['regime']:>6} {r['measured_s']:10.3f} "
              f"{r['predicted_s']:8.3f} {r['error']:+7.1%} {loo:>7} {r['adopted_predicted_s']:9.3f} "
              f"{r['adopted_error']:+7.1%} {ad_loo:>8}")
    ad = out["adopted"]

    def line(groups: dict) -> str:
        return "; ".join(f"{k.replace('_', ' ')} ({v['runs']} runs): mean |error| {v['mean_abs_error']:.1%}, "
                         f"max {v['max_abs_error']:.1%}, mean {v['mean_error']:+.1%}"
                         for k, v in groups.items() if k != "source")

    print(f"the planner's calibration ({ad['source']}): " + line(ad))
    print("the same, each fitted run left out of the whole calibration: " + line(out["adopted_leave_one_out"]))
    if out["defaults_differ"]:
        print(f"TimeCalibration defaults differ from this fit: {', '.join(out['defaults_differ'])}")
    if out["prior_differs"]:
        print(f"the committed fit (fit_time.PRIOR, {datafiles.rel(PRIOR_FIT)}) differs from this fit: "
              f"{', '.join(out['prior_differs'])}; write it there and refit the sweep (--sweep DIR --write)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
