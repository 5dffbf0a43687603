"""Every figure the benchmarks' docs state, made from the result files (render.py writes them into the docs).

``DOCS`` maps a doc (relative to the repository) to a function returning its figures: slot name -> the slot's text,
or a function of the slot's committed text. The formats here are the docs' formats (tokens/s with thousands
separators, MFU as a percentage to two places, ...), so a figure is written once, from its data, in one place.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"


def _load_schema():
    spec = importlib.util.spec_from_file_location("benchmarks_schema", BENCH / "schema.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the models' annotations through it
    spec.loader.exec_module(module)
    return module


schema = _load_schema()


# ---- reading the data ---------------------------------------------------------------------------------------------


def data(rel: str) -> dict:
    """A JSON file under benchmarks/results/."""
    return json.loads((RESULTS / rel).read_text())


def lines(rel: str) -> list[dict]:
    """A JSON-lines file under benchmarks/results/."""
    return [json.loads(line) for line in (RESULTS / rel).read_text().splitlines() if line.strip()]


def median_step(rel: str, warmup: int = 8) -> float:
    """The median window step of an engine_steps.py run (its steps after ``warmup``)."""
    return statistics.median(s["step_time_s"] for s in data(rel)["steps"][warmup:])


# ---- formats --------------------------------------------------------------------------------------------------------


def n0(x: float) -> str:
    """30,677"""
    return f"{x:,.0f}"


def pct(x: float, places: int = 2) -> str:
    """0.4967 -> 4.97% (a fraction shown as a percentage)"""
    return f"{100 * x:.{places}f}%"


def spct(x: float, places: int = 2) -> str:
    """a signed percentage: +1.11%"""
    return f"{100 * x:+.{places}f}%"


def f(x: float, places: int) -> str:
    """``x`` to ``places`` decimals: f(0.67471, 4) -> 0.6747"""
    return f"{x:.{places}f}"


def sci(x: float, places: int = 1) -> str:
    """3.1e-4 (no zero-padded exponent, as the docs write it)"""
    mant, exp = f"{x:.{places}e}".split("e")
    return f"{mant}e{int(exp)}"


# ---- tables whose figure cells come from the data -------------------------------------------------------------------

_NUMBER = re.compile(r"^(\*\*)?([-+]?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?%?|-)(\*\*)?")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def set_number(cell: str, value: str) -> str:
    """``cell`` with its leading figure replaced by ``value``; bold and the words after the figure stay."""
    m = _NUMBER.match(cell)
    if not m:
        raise ValueError(f"cell {cell!r} does not start with a figure")
    bold = "**" if m.group(1) and m.group(3) else ""
    return f"{bold}{value}{bold}{cell[m.end():]}"


class Whole:
    """A table cell's whole text (its figure and the words the data also owns, e.g. "1.008 (step 15)")."""

    def __init__(self, text: str) -> None:
        self.text = text


def table(key: Callable[[list[str]], str | None], columns: dict[int, Callable[[str], str]]) -> Callable[[str], str]:
    """A markdown table in a slot whose figure cells are the data's: for each body row, ``key(cells)`` names the
    row's data (None: a row with no figures), and ``columns[i](key)`` is column i's figure: a string replaces the
    cell's leading figure, a ``Whole`` the cell, None leaves it. The header, the row order and every other cell
    are the doc's."""

    def fill(text: str) -> str:
        out, body = [], False
        for line in text.split("\n"):
            indent = line[: len(line) - len(line.lstrip())]
            if not line.lstrip().startswith("|"):
                body = False
                out.append(line)
                continue
            if set(line.replace("|", "").strip()) <= set("-: "):  # the separator: the body follows
                body = True
                out.append(line)
                continue
            if not body:  # the header
                out.append(line)
                continue
            cells = _cells(line)
            k = key(cells)
            if k is None:
                out.append(line)
                continue
            for i, fig in columns.items():
                value = fig(k)
                if value is None:  # no figure in this row's cell (a "-")
                    continue
                cells[i] = value.text if isinstance(value, Whole) else set_number(cells[i], value)
            out.append(indent + "|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
        return "\n".join(out)

    return fill


def first_code(cells: list[str]) -> str:
    """The first `code` span of a row's first cell: the row's file or folder."""
    m = re.search(r"`([^`]+)`", cells[0])
    if not m:
        raise ValueError(f"row {cells!r} names no file in its first cell")
    return m.group(1)


# ---- the attribution folders (engine_steps.py runs, kept or rejected by levers_choose.py's rule) -------------------


class Runs:
    """The engine_steps.py runs of one folder, and levers_choose.py's baseline: the mean of ``first`` and ``again``
    (the same engine run first and last), their difference the drift."""

    def __init__(self, folder: str, first: str = "shipped", again: str = "shipped-again") -> None:
        self.folder, self.first, self.again = folder, first, again

    def json(self, run: str) -> dict:
        return data(f"{self.folder}/{run}.json")

    def tps(self, run: str) -> float:
        return self.json(run)["tokens_per_s_per_gpu"]

    @property
    def base(self) -> float:
        return (self.tps(self.first) + self.tps(self.again)) / 2

    @property
    def drift(self) -> float:
        return abs(self.tps(self.first) - self.tps(self.again)) / self.base

    def median(self, run: str) -> float:
        return median_step(f"{self.folder}/{run}.json")

    def worst_grad_norm(self, runs, warmup: int = 8) -> float:
        return max(max(s["grad_norm"] for s in self.json(r)["steps"][warmup:]) for r in runs)

    def run_table(self, median: bool = False, gain: bool = False) -> Callable[[str], str]:
        """The table of runs: | `NAME.json` | what | tokens/s | MFU | mean step | [median step |] [vs baseline |]
        final loss |."""
        cols = {
            2: lambda r: n0(self.tps(r)),
            3: lambda r: pct(self.json(r)["mfu"]),
            4: lambda r: f(self.json(r)["step_time_mean_s"], 4),
        }
        i = 5
        if median:
            cols[i] = lambda r: f(self.median(r), 4)
            i += 1
        if gain:
            cols[i] = lambda r: spct(self.tps(r) / self.base - 1)
            i += 1
        cols[i] = lambda r: f(self.json(r)["final_loss"], 5)
        return table(lambda c: first_code(c).removesuffix(".json"), cols)


def profile_idle(p: dict) -> dict:
    """A profile's span, busy and idle time per step, and its idle time by gap length."""
    bins = {b["gap_us"]: b for b in p.get("idle_by_gap_length", [])}
    out = {
        "span": f(p["span_seconds_per_step"], 4),
        "busy": f(p["busy_seconds_per_step"], 4),
        "idle-ms": f(1e3 * p["idle_seconds_per_step"], 1),
        "idle-pct": pct(p["idle_seconds_per_step"] / p["span_seconds_per_step"], 1),
        "busy-pct": pct(p["busy_seconds_per_step"] / p["span_seconds_per_step"], 1),
    }
    for key, name in (("0-100", "short"), ("100-1000", "mid"), ("1000-inf", "long")):
        if key in bins:
            out[f"{name}-ms"] = f(1e3 * bins[key]["seconds_per_step"], 2)
            out[f"{name}-count"] = f"{bins[key]['count_per_step']:,g}"
    return out


def profile_classes(p: dict) -> Callable[[str], str]:
    """The table | class | ms a step | of a profile's GPU time by class."""
    secs = {c["class"]: c["seconds_per_step"] for c in p["classes"]}
    return table(lambda c: c[0], {1: lambda name: f(1e3 * secs[name], 1)})


def class_ms(p: dict, name: str, places: int = 1) -> str:
    return f(1e3 * next(c["seconds_per_step"] for c in p["classes"] if c["class"] == name), places)


def top_kernel(p: dict, cls: str, words: str) -> float:
    """Seconds a step of the first top kernel of class ``cls`` whose name holds ``words``."""
    kernels = dict(next(c for c in p["classes"] if c["class"] == cls)["top_kernels"])
    return next(v for k, v in kernels.items() if words in k)


def prefixed(prefix: str, figs: dict) -> dict:
    return {f"{prefix}.{k}": v for k, v in figs.items()}


# ---- results/engine-options-each-alone -------------------------------------------------------------------------------

OPTIONS = Runs("engine-options-each-alone")
OPTION_RUNS = (
    "shipped",
    "no-wgrad-accumulation-fusion",
    "clip-host-sync",
    "optimizer-cuda-graph",
    "router-fusion",
    "no-permute-fusion",
    "overlap-grad-reduce",
    "shipped-again",
)


def options_gain(run: str) -> float:
    return OPTIONS.tps(run) / OPTIONS.base - 1


def engine_options() -> dict:
    o = OPTIONS
    out = {
        "runs": o.run_table(gain=True),
        "base": n0(o.base),
        "drift": pct(o.drift),
        "twice-drift": pct(2 * o.drift),
        "losses-agree": sci(
            max(o.json(r)["final_loss"] for r in OPTION_RUNS) / min(o.json(r)["final_loss"] for r in OPTION_RUNS) - 1, 0
        ),
    }
    for run in OPTION_RUNS[1:-1]:
        out[f"gain.{run}"] = pct(abs(options_gain(run)))
    out["idle-ms"] = f(1e3 * data("side-by-side/2026-12-03/profile-shipped.json")["idle_seconds_per_step"], 1)
    return out


# ---- results/side-by-side --------------------------------------------------------------------------------------------

SITTINGS = (
    "2026-12-02",
    "2026-12-03",
    "2026-12-03-clip-skip-and-gated-residual",
    "2026-12-03-early-expert-counts-and-pre-mlp-norm",
    "2026-12-03-te-swiglu-backward-and-first-microbatch-writes",
    "2026-12-03-triton-adam",
    "2026-12-04",
)
#: the like-for-like sitting: Bridge given the engine's own mapping of the recipe (the precision-aware optimizer and
#: gradient-accumulation fusion included), on another card (an H100) and the slice cut to fit it, so apart from SITTINGS
LIKE = "2026-12-08-like-for-like-h100"


def bridge_run(sitting: str, i: int) -> dict:
    """A Bridge run's result: its bridge-slice.json, or where that file did not come back from the device, the same
    result as the run printed it, its log's last line (the side-by-side README says which)."""
    folder = RESULTS / "side-by-side" / sitting / f"bridge{i}"
    if (folder / "bridge-slice.json").exists():
        return json.loads((folder / "bridge-slice.json").read_text())
    return json.loads((folder / "bridge-iterations.log").read_text().strip().splitlines()[-1])


def runner_runs(sitting: str) -> list[dict]:
    return [data(f"side-by-side/{sitting}/runner{i}/results.json") for i in (1, 2, 3)]


def sitting_summary(sitting: str) -> dict:
    return data(f"side-by-side/{sitting}/summary.json")


def sitting_mfu(sitting: str) -> float:
    return statistics.median(r["mfu"] for r in runner_runs(sitting))


#: tokens/s at 53% MFU on the slice, and the step that takes (GBS 8 x 4,096 tokens)
def target_53(runner: dict) -> tuple[float, float]:
    tps = 0.53 * runner["peak_tflops"] * 1e12 / runner["flops_per_token"]["training"]
    return tps, 8 * 4096 / tps


def _one(values: list, what: str):
    """The value every run of a sitting recorded (they are the same settings, one per process); an error otherwise."""
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"side-by-side/{LIKE}: the runs differ in {what}: {values}")
    return values[0]


def _word(v) -> str:
    return f"`{json.dumps(v)}`" if isinstance(v, (bool, type(None))) else f"`{v}`"


#: the settings both sides record: row -> (the runner's value from results.json and recipe.yaml, Bridge's from
#: bridge-slice.json's settings)
LIKE_SETTINGS: dict[str, tuple[Callable[[dict, dict], object], Callable[[dict], object]]] = {
    "gradient-accumulation fusion": (lambda r, rec: r["engine_info"]["levers"]["gradient_accumulation_fusion"],
                                     lambda b: b["gradient_accumulation_fusion"]),
    "precision-aware optimizer": (lambda r, rec: rec["optimizer"]["precision_aware"],
                                  lambda b: b["use_precision_aware_optimizer"]),
    "parameter remainders": (lambda r, rec: rec["optimizer"]["param_remainders"],
                             lambda b: b["store_param_remainders"]),
    "distributed optimizer": (lambda r, rec: r["engine_info"]["distributed_optimizer"],
                              lambda b: b["use_distributed_optimizer"]),
    "dispatcher": (lambda r, rec: r["engine_info"]["dispatcher"], lambda b: b["moe_token_dispatcher_type"]),
    "permutation fusion": (lambda r, rec: r["engine_info"]["levers"]["moe_permute_fusion"],
                           lambda b: b["moe_permute_fusion"]),
    "router fusion": (lambda r, rec: r["engine_info"]["levers"]["moe_router_fusion"],
                      lambda b: b["moe_router_fusion"]),
    "experts, top-k": (lambda r, rec: (rec["model"]["overrides"]["num_local_experts"],
                                       rec["model"]["overrides"]["num_experts_per_tok"]),
                       lambda b: (b["num_moe_experts"], b["moe_router_topk"])),
    "MBS, GBS, sequence": (lambda r, rec: (rec["batch"]["mbs"], rec["batch"]["gbs"], rec["batch"]["seq_length"]),
                           lambda b: (b["mbs"], b["gbs"], b["seq_length"])),
    "collector by hand": (lambda r, rec: r["gc"]["manual"], lambda b: b["manual_gc"]),
}
#: the runner's levers with a Bridge setting in LIKE_SETTINGS, or off on both sides by bridge_slice.py's construction
#: (no overlap at one GPU; the engine's optimizer mapping carries optimizer_cuda_graph off)
LIKE_SHARED_LEVERS = ("gradient_accumulation_fusion", "moe_permute_fusion", "moe_router_fusion", "overlap_grad_reduce",
                      "optimizer_cuda_graph")


def like_for_like() -> dict:
    """The like-for-like sitting's figures and the differences its files record beside the ratio."""
    import yaml

    folder = RESULTS / "side-by-side" / LIKE
    runner = runner_runs(LIKE)
    bridge = [bridge_run(LIKE, i) for i in (1, 2, 3)]
    recipe = _one([yaml.safe_load((folder / f"runner{i}" / "recipe.yaml").read_text()) for i in (1, 2, 3)], "recipe")
    prints = [json.loads((folder / f"runner{i}" / "fingerprint.json").read_text()) for i in (1, 2, 3)]
    settings = _one([{k: v for k, v in b["settings"].items() if k != "cli"} for b in bridge], "Bridge's settings")
    summary = sitting_summary(LIKE)
    head, row = (folder / "nvidia-smi.csv").read_text().strip().splitlines()
    gpu = dict(zip([h.strip() for h in head.split(",")], [c.strip() for c in row.split(",")], strict=True))
    cpu = _one([p["host"]["cpu"] for p in prints], "host CPU")
    rev = _one([p["identity"]["source_revision"] for p in prints], "source revision")
    flops = _one([r["flops_per_token"]["training"] for r in runner] + [b["flops_per_token"] for b in bridge],
                 "model FLOPs per token")
    levers = _one([r["engine_info"]["levers"] for r in runner], "the runner's levers")
    compiled = _one([r["engine_info"]["torch_compile_elementwise"] for r in runner], "torch_compile_elementwise")
    experts = LIKE_SETTINGS["experts, top-k"]
    if experts[0](runner[0], recipe) != experts[1](settings):
        raise ValueError(f"side-by-side/{LIKE}: the runner's experts differ from Bridge's")

    def setting_cell(side: int):
        def cell(name: str) -> Whole:
            v = LIKE_SETTINGS[name][0](runner[0], recipe) if side == 0 else LIKE_SETTINGS[name][1](settings)
            return Whole(", ".join(map(str, v)) if isinstance(v, tuple) else _word(v))

        return cell

    own = {k: v for k, v in levers.items() if k not in LIKE_SHARED_LEVERS} | {"torch_compile_elementwise": compiled}
    unexpressed = _one([b["not_expressed"] for b in bridge], "not_expressed")
    without = _one([b["recipe_fields_without_provider_field"] for b in bridge], "recipe_fields_without_provider_field")
    return {
        "gpu": f"{gpu['name']} ({n0(float(gpu['memory.total [MiB]'].split()[0]))} MiB, "
        f"{float(gpu['power.limit [W]'].split()[0]):.0f} W, max SM clock {gpu['clocks.max.sm [MHz]'].split()[0]} MHz, "
        f"driver {gpu['driver_version']})",
        "host": f'"{cpu["model"]}", {cpu["logical_cpus"]} cores',
        "revision": f"`{rev['revision'][:7]}`, {'dirty' if rev['dirty'] else 'a clean tree'}",
        "versions": ", ".join(f"{k} {v}" for k, v in _one([b["versions"] for b in bridge], "versions").items()),
        "experts": "{} experts, top-{}".format(*experts[1](settings)),
        "active": n0(_one([r["active_params"] for r in runner], "active parameters")),
        "gflop": f(flops / 1e9, 2),
        "peak": n0(_one([r["peak_tflops"] for r in runner] + [b["peak_tflops"] for b in bridge], "peak")),
        "peak-source": _one([r["peak_source"] for r in runner] + [b["peak_source"] for b in bridge], "peak source"),
        "runner-median": n0(summary["runner_median"]),
        "bridge-median": n0(summary["bridge_median"]),
        "ratio": f"{summary['ratio_of_medians']:.3f}x",
        "ahead": pct(summary["ratio_of_medians"] - 1, 1),
        "mfu": pct(statistics.median(r["mfu"] for r in runner)),
        "worst": f(max(r["step_time_worst_ratio"] for r in runner), 3),
        "runner-memory": f(max(r["peak_memory_gib"] for r in runner), 2),
        "bridge-memory": f(max(b["peak_memory_gib"] for b in bridge), 2),
        "settings": table(lambda c: c[0], {1: setting_cell(0), 2: setting_cell(1)}),
        "wgrad": _one([b["output_layer_wgrad_accumulation"] for b in bridge], "output_layer_wgrad_accumulation"),
        "without-field": ", ".join(f"`{x}`" for x in without) or "none",
        "fp32-residual": _word(settings["fp32_residual_connection"]),
        "cross-entropy": _word(settings["cross_entropy_fusion_impl"]) if settings["cross_entropy_loss_fusion"]
        else "none (unfused)",
        "router-gain": spct(options_gain("router-fusion")),
        "not-expressed": "\n" + "\n".join(f"  - {x}" for x in unexpressed) + "\n",
        "runner-own": "\n" + "\n".join(f"  - `{k}`: {_word(v) if isinstance(v, bool) or v is None else v}"
                                        for k, v in own.items()) + "\n",
    }


def side_by_side() -> dict:
    out: dict = {}

    def sitting_row(cells):
        return first_code(cells).rstrip("/")

    out["sittings"] = table(
        sitting_row,
        {
            1: lambda s: n0(sitting_summary(s)["runner_median"]),
            2: lambda s: pct(sitting_mfu(s)),
            3: lambda s: n0(sitting_summary(s)["bridge_median"]),
            4: lambda s: f(sitting_summary(s)["ratio_of_medians"], 3),
            5: lambda s: f(max(r["step_time_worst_ratio"] for r in runner_runs(s)), 3),
        },
    )
    for s in (*SITTINGS, LIKE):

        def run(name, s=s):
            kind, i = name[:-1], int(name[-1])
            return data(f"side-by-side/{s}/runner{i}/results.json") if kind == "runner" else bridge_run(s, i)

        out[f"{s}.runs"] = table(
            lambda c: c[0],
            {
                1: lambda n, run=run: n0(run(n)["tokens_per_s_per_gpu"]),
                2: lambda n, run=run: pct(run(n)["mfu"]),
                3: lambda n, run=run: f(
                    run(n)["step_time_median_s" if n.startswith("runner") else "step_time_mean_s"], 4
                ),
                4: lambda n, run=run: (
                    Whole(f"{run(n)['step_time_worst_ratio']:.3f} (step {run(n)['step_time_worst_step']})")
                    if n.startswith("runner")
                    else None
                ),
                5: lambda n, run=run: f"{run(n)['step_time_cv_percent']:.2f}%" if n.startswith("runner") else None,
            },
        )
        summary = sitting_summary(s)
        out[f"{s}.runner-median"] = n0(summary["runner_median"])
        out[f"{s}.bridge-median"] = n0(summary["bridge_median"])
        out[f"{s}.ratio"] = f"{summary['ratio_of_medians']:.3f}x"
    out.update(prefixed("like", like_for_like()))
    # the second sitting's profile
    p = data("side-by-side/2026-12-03/profile-shipped.json")
    idle = profile_idle(p)
    idle["short-count"] = n0(next(b for b in p["idle_by_gap_length"] if b["gap_us"] == "0-100")["count_per_step"])
    out.update(prefixed("profile", {k: idle[k] for k in idle if k not in ("busy-pct", "long-count")}))
    for name in (
        "grouped expert GEMM",
        "dense GEMM",
        "norms and elementwise",
        "optimizer",
        "attention",
        "router and permutation",
    ):
        out[f"profile.{name.replace(' ', '-')}"] = class_ms(p, name)
    # the reading
    out["worst"] = f(max(r["step_time_worst_ratio"] for s in SITTINGS for r in runner_runs(s)), 3)
    for s in SITTINGS:
        out[f"{s}.ahead"] = pct(sitting_summary(s)["ratio_of_medians"] - 1, 1)
    last = runner_runs(SITTINGS[-1])
    out["mfu"] = pct(statistics.median(r["mfu"] for r in last))
    tps53, step53 = target_53(last[0])
    step = statistics.median(r["step_time_median_s"] for r in last)
    out["target-tps"] = n0(tps53)
    out["target-step"] = f(step53, 3)
    out["median-step"] = f(step, 4)
    out["under-ms"] = f(1e3 * (step53 - step), 0)
    out["under-pct"] = pct(1 - step / step53, 1)
    sixth = runner_runs("2026-12-03-triton-adam")
    step6 = statistics.median(r["step_time_median_s"] for r in sixth)
    out["sixth.mfu"] = pct(statistics.median(r["mfu"] for r in sixth))
    out["sixth.median-step"] = f(step6, 4)
    out["sixth.over-ms"] = f(1e3 * (step6 - step53), 0)
    out["sixth.over-pct"] = pct(step6 / step53 - 1, 1)
    q = data("adam/profile-shipped.json")
    gemm = sum(c["seconds_per_step"] for c in q["classes"] if c["class"] in ("grouped expert GEMM", "dense GEMM"))
    out["adam.idle-ms"] = f(1e3 * q["idle_seconds_per_step"], 1)
    out["adam.busy-pct"] = pct(q["busy_seconds_per_step"] / q["span_seconds_per_step"], 1)
    out["adam.gemm-ms"] = f(1e3 * gemm, 1)
    out["adam.busy-ms"] = f(1e3 * q["busy_seconds_per_step"], 1)
    out["adam.adam-ms"] = f(1e3 * top_kernel(q, "optimizer", "_adam"), 2)
    out["adam.l2norm-ms"] = f(1e3 * top_kernel(q, "optimizer", "L2NormFunctor"), 2)
    te = data("te-swiglu-backward-and-first-microbatch-writes/profile-shipped.json")
    out["te.adam-ms"] = f(1e3 * top_kernel(te, "optimizer", "AdamFunctorMaster"), 2)
    out["clip-profile.idle-ms"] = f(
        1e3 * data("clip-skip-and-gated-residual/profile-shipped.json")["idle_seconds_per_step"], 1
    )
    return out


# ---- results/clip-skip-and-gated-residual and results/expert-gemm ---------------------------------------------------

CLIP = Runs("clip-skip-and-gated-residual")
CLIP_RUNS = ("shipped", "te-clip-scale", "shipped-again", "before", "shipped-third")


def clip_skip() -> dict:
    c = CLIP
    skip = c.base / c.tps("te-clip-scale") - 1
    losses = [c.json(r)["final_loss"] for r in CLIP_RUNS]
    spread = max(losses) / min(losses) - 1
    early = [s["grad_norm"] for s in c.json("shipped")["steps"][:4]]
    k = data("clip-skip-and-gated-residual/clip-scale.json")
    p = data("clip-skip-and-gated-residual/profile-shipped.json")
    morning = data("side-by-side/2026-12-03/profile-shipped.json")
    idle = profile_idle(p)
    out = {
        "runs": c.run_table(),
        "skip": spct(skip),
        "base": n0(c.base),
        "drift": pct(c.drift),
        "against": spct(c.tps("te-clip-scale") / c.base - 1),
        "twice-drift": pct(2 * c.drift),
        "both": spct(c.tps("shipped-third") / c.tps("before") - 1),
        "elementwise-ms": class_ms(p, "norms and elementwise"),
        "morning.elementwise-ms": class_ms(morning, "norms and elementwise"),
        "morning.idle-ms": f(1e3 * morning["idle_seconds_per_step"], 1),
        "later": pct(1 - c.tps("shipped-third") / c.tps("shipped-again")),
        "losses-agree": sci(spread, 0),
        "losses-spread": f"{spread:.1e}",
        "worst-grad-norm": f(c.worst_grad_norm(CLIP_RUNS), 3),
        "early-norms": f"{early[0]:.2f}-{early[-1]:.2f}",
        "elements": n0(k["elements"]),
        "views": str(k["views"]),
        "spans": str(k["spans"]),
        "kernel": table(
            lambda cells: cells[0].split()[0],
            {
                1: lambda coeff: Whole(
                    f"{k[f'te_coeff_{coeff}_ms']:.2f} ms"
                    + ("" if coeff == "1" else f" ({k[f'te_coeff_{coeff}_TBps']:.2f} TB/s)")
                ),
                2: lambda coeff: Whole(
                    f"{k[f'ours_coeff_{coeff}_ms']:.2f} ms"
                    + ("" if coeff == "1" else f" ({k[f'ours_coeff_{coeff}_TBps']:.2f} TB/s)")
                ),
            },
        ),
        "ours-1-ms": f(k["ours_coeff_1_ms"], 2),
        "bitwise": "yes" if k["bitwise_equal_to_te"] else "no",
        "classes": profile_classes(p),
        "optimizer-ms": class_ms(p, "optimizer"),
        "adam-ms": f(1e3 * top_kernel(p, "optimizer", "AdamFunctorMaster"), 2),
        "l2norm-ms": f(1e3 * top_kernel(p, "optimizer", "L2NormFunctor"), 2),
    }
    out.update(prefixed("profile", {k2: v for k2, v in idle.items() if k2 != "busy-pct"}))
    return out


def expert_gemm() -> dict:
    d = data("expert-gemm/expert-gemm.json")
    by = {(r["gemm"], r["split"]): r for r in d["rows"]}
    cell = lambda way: lambda key: Whole(
        f"{1e3 * by[key][f'{way}_s']:.2f} ms, {by[key][f'{way}_tflops']:.0f} TFLOP/s"
    )  # noqa: E731
    slower = [r["grouped_mm_s"] / r["te_s"] - 1 for r in d["rows"]]
    p = data("clip-skip-and-gated-residual/profile-shipped.json")
    grouped = next(c["seconds_per_step"] for c in p["classes"] if c["class"] == "grouped expert GEMM")
    step = {s: 4 * (by[("fc1", s)]["te_s"] + by[("fc2", s)]["te_s"]) for s in ("even", "uneven")}
    return {
        "rows": table(lambda c: (c[0], c[1]), {2: cell("te"), 3: cell("loop"), 4: cell("grouped_mm")}),
        "grouped-mm-slower": f"{100 * min(slower):.0f}-{100 * max(slower):.0f}%",
        "even-ms": f(1e3 * step["even"], 1),
        "uneven-ms": f(1e3 * step["uneven"], 1),
        "in-step-ms": f(1e3 * grouped, 1),
        "above": f"{100 * (grouped / step['uneven'] - 1):.0f}-{100 * (grouped / step['even'] - 1):.0f}%",
        "elementwise-ms": class_ms(p, "norms and elementwise"),
        "optimizer-ms": class_ms(p, "optimizer"),
        "idle-ms": f(1e3 * p["idle_seconds_per_step"], 1),
    }


# ---- results/early-expert-counts-and-pre-mlp-norm and results/te-swiglu-backward-and-first-microbatch-writes ---------


def both_kept(r: Runs, runs: tuple[str, ...]) -> dict:
    """The standard attribution of two changes kept together against ``before`` (both off): the gain, the baseline,
    its drift and twice it; the final losses' spread; the largest window gradient norm."""
    losses = [r.json(run)["final_loss"] for run in runs]
    spread = max(losses) / min(losses) - 1
    return {
        "both": spct(r.base / r.tps("before") - 1),
        "base": n0(r.base),
        "drift": pct(r.drift),
        "twice-drift": pct(2 * r.drift),
        "losses-agree": sci(spread, 0),
        "losses-spread": f"{spread:.1e}",
        "worst-grad-norm": f(r.worst_grad_norm(runs), 3),
        "runs": r.run_table(),
    }


EARLY = Runs("early-expert-counts-and-pre-mlp-norm")
EARLY_RUNS = ("shipped", "before", "late-counts", "separate-pre-mlp-norm", "shipped-again")


def early_counts() -> dict:
    e = EARLY
    out = both_kept(e, EARLY_RUNS)
    out["counts"] = spct(e.base / e.tps("late-counts") - 1)
    out["norm"] = spct(e.base / e.tps("separate-pre-mlp-norm") - 1)
    p = data("early-expert-counts-and-pre-mlp-norm/profile-shipped.json")
    before = data("clip-skip-and-gated-residual/profile-shipped.json")
    out.update(prefixed("profile", profile_idle(p)))
    out.update(
        prefixed(
            "before",
            {k: v for k, v in profile_idle(before).items() if k in ("idle-ms", "idle-pct", "long-ms", "long-count")},
        )
    )
    blocked = p["idle_after_blocking_calls"]
    out["blocked-count"] = f"{blocked['count_per_step']:g}"
    out["blocked-ms"] = f(1e3 * blocked["seconds_per_step"], 2)
    drains = {f"{d['seconds']:.2f}" for d in (g["drained_by"] for g in p["longest_gaps"]) if d}
    if len(drains) != 1:
        raise ValueError(f"the profile's blocking waits differ ({sorted(drains)}): say each in the README")
    out["waited-s"] = drains.pop()
    gl = [g["seconds"] for g in p["longest_gaps"] if "_GroupedLinear" in g["operators"] and g["seconds"] > 5e-4]
    out["grouped-linear-gaps"] = f"{1e3 * min(g for g in gl if g > 8e-4):.1f}-{1e3 * max(gl):.1f}"
    out["classes"] = profile_classes(p)
    return out


TE_SWIGLU = Runs("te-swiglu-backward-and-first-microbatch-writes")
TE_SWIGLU_RUNS = ("shipped", "before", "mcore-swiglu", "whole-buffer", "shipped-again", "candidate-multi-kernel")


def site_ms(c: dict, words: str) -> float:
    """Seconds a step of a profile class's top sites whose kernel or operators hold ``words``."""
    return sum(s["seconds_per_step"] for s in c["top_sites"] if words in s["kernel"] + s["operators"])


def te_swiglu() -> dict:
    r = TE_SWIGLU
    out = both_kept(r, TE_SWIGLU_RUNS)
    out["swiglu"] = spct(r.tps("whole-buffer") / r.tps("before") - 1)
    out["writes"] = spct(r.base / r.tps("whole-buffer") - 1)
    out["candidate"] = pct(-(r.base / r.tps("candidate-multi-kernel") - 1))
    steps = [s["step_time_s"] for s in r.json("mcore-swiglu")["steps"]]
    worst = max(steps[8:])
    out["stall-s"] = f(worst, 3)
    out["stall-step"] = str(steps.index(worst) + 1)
    out["stall-ratio"] = f(worst / r.median("mcore-swiglu"), 2)
    shipped = (r.median("shipped") + r.median("shipped-again")) / 2
    out["mcore-median"] = f(r.median("mcore-swiglu"), 4)
    out["shipped-median"] = f(shipped, 4)
    out["mcore-median-gain"] = spct(r.median("mcore-swiglu") / shipped - 1)
    elements = re.search(r"\(([\d,]+) of ([\d,]+) elements\)", r.json("shipped")["levers"]["grad_buffer_zeroing"])
    out["written-elements"], out["buffer-elements"] = elements.group(1), elements.group(2)
    k = data("te-swiglu-backward-and-first-microbatch-writes/kernels.json")
    sw = k["swiglu"]
    mc, te = sw["megatron-core bias_swiglu_impl (compiled)"], sw["transformer_engine ops.SwiGLU"]
    mine = sw["the engine's: megatron-core's forward, TE's dswiglu backward"]
    out.update(
        {
            "mc.backward-ms": f(mc["backward_ms"], 2),
            "te.backward-ms": f(te["backward_ms"], 2),
            "te.backward-gbps": n0(te["backward_gb_per_s"]),
            "mc.forward-ms": f(mc["forward"]["median_ms"], 2),
            "te.forward-ms": f(te["forward"]["median_ms"], 2),
        }
    )
    norm = k["post_expert_norm"]
    default, forced, multi = (
        norm["inductor default"],
        norm["mix-order reduction forced (non-strict)"]["backward"],
        norm["multi-kernel"],
    )
    out.update(
        {
            "multi.forward-ms": f(multi["forward"]["median_ms"], 2),
            "default.forward-ms": f(default["forward"]["median_ms"], 2),
            "multi.backward-ms": f(multi["backward"]["median_ms"], 2),
            "default.backward-ms": f(default["backward"]["median_ms"], 2),
        }
    )
    adam = k["adam"]
    first = adam[f"chunk {adam['default_chunk_size']}"]
    larger = [adam[f"chunk {c * adam['default_chunk_size']}"]["median_ms"] for c in (4, 16)]
    zero = k["zero_grad_buffer"]
    mine_kernels = list(mine["forward_and_backward"]["kernels_ms"].values())[:2]
    dk = list(default["backward"]["kernels_ms"].values())
    rows = {
        "megatron-core's SwiGLU, forward + backward": (
            mc["forward_and_backward"]["median_ms"],
            f"backward {mc['backward_ms']:.2f} ms",
        ),
        "TE's `ops.SwiGLU`, forward + backward": (
            te["forward_and_backward"]["median_ms"],
            f"forward {te['forward']['median_ms']:.2f} ms, backward {te['backward_ms']:.2f} ms",
        ),
        "the engine's: megatron-core's forward, TE's backward": (
            mine["forward_and_backward"]["median_ms"],
            f"its kernels: {min(mine_kernels):.2f} + {max(mine_kernels):.2f} ms",
        ),
        "the post-expert norm's backward, as compiled": (
            default["backward"]["median_ms"],
            f"two kernels: the row pass ({dk[0]:.2f} ms) and the weight's column sum ({dk[1]:.2f} ms), which reads the input again",
        ),
        "the same with Inductor's mix-order reduction forced": (forced["median_ms"], None),
        f"TE's multi-tensor Adam (fp32 master), {adam['parameters'] / 1e9:.2f} B parameters": (
            first["median_ms"],
            f"{first['gb_per_s']:,.0f} GB/s; {first['slice_ms_at_this_rate']:.1f} ms at the slice's 4.33 B; larger chunks are "
            f"slower ({larger[0]:.2f}, {larger[1]:.2f} ms)",
        ),
        "zeroing 4.33 B fp32": (zero["median_ms"], f"{zero['gb_per_s']:,.0f} GB/s"),
    }
    out["kernels"] = table(
        lambda c: c[0],
        {1: lambda key: f(rows[key][0], 2), 2: lambda key: None if rows[key][1] is None else Whole(rows[key][1])},
    )
    p = data("te-swiglu-backward-and-first-microbatch-writes/profile-shipped.json")
    before = data("early-expert-counts-and-pre-mlp-norm/profile-shipped.json")
    idle = profile_idle(p)
    out.update(prefixed("profile", {k2: idle[k2] for k2 in ("span", "busy", "idle-ms", "idle-pct")}))
    out["classes"] = profile_classes(p)
    ew = next(c for c in p["classes"] if c["class"] == "norms and elementwise")
    ew_old = next(c for c in before["classes"] if c["class"] == "norms and elementwise")
    out["ew-ms"], out["ew-old-ms"] = f(1e3 * ew["seconds_per_step"], 1), f(1e3 * ew_old["seconds_per_step"], 1)
    out["dgated-ms"] = f(1e3 * site_ms(ew, "dgated_act_kernel"), 2)
    out["mcore-dswiglu-ms"] = f(1e3 * site_ms(ew_old, "triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split"), 2)
    out["zero-old-ms"] = f(1e3 * site_ms(ew_old, "aten::zero_"), 2)
    gemm = lambda q: sum(c["seconds_per_step"] for c in q["classes"] if "GEMM" in c["class"])  # noqa: E731
    out["gemm-ms"], out["gemm-old-ms"] = f(1e3 * gemm(p), 1), f(1e3 * gemm(before), 1)
    out["norm-bwd-ms"] = f(1e3 * site_ms(ew, "CompiledFunctionBackward[[131072,4096]]"), 1)
    return out



# ---- results/adam, normbwd, embedgrad (engine_steps.py runs kept or rejected by normbwd_choose.py's rule) -----------

#: bytes Adam moves per parameter: the gradient, master and both moments read in fp32 (16), master and moments
#: written in fp32 (12) and the bf16 weight written (2)
ADAM_BYTES = 30
#: bytes the clip's gradient norm reads per parameter (the fp32 main gradient)
NORM_BYTES = 4


def slice_elements() -> int:
    """The slice's gradient buffer, in elements (clip-scale.json measured the clip over it)."""
    return data("clip-skip-and-gated-residual/clip-scale.json")["elements"]


def gpu_test(folder: str) -> str:
    """The pytest summary count of a folder's gpu-test.txt: "11 passed"."""
    text = (RESULTS / folder / "gpu-test.txt").read_text()
    found = re.findall(r"(\d+ passed)", text)
    if not found:
        raise ValueError(f"{folder}/gpu-test.txt has no pytest summary")
    return found[-1]


def rule_verdict(r: Runs, without: str = "without") -> dict:
    """levers_choose.py's rule on a with / with-again / without folder: the gain, the baseline, the drift and twice
    it, and the gain by the median step; the final losses' spread and the largest window gradient norm."""
    with_median = (r.median(r.first) + r.median(r.again)) / 2
    return {
        "gain": spct(r.base / r.tps(without) - 1),
        "base": n0(r.base),
        "drift": pct(r.drift),
        "twice-drift": pct(2 * r.drift),
        "median-gain": spct(r.median(without) / with_median - 1),
    }


ADAM = Runs("adam", first="with", again="with-again")
ADAM_RUNS = ("with", "without", "with-again", "with-norm-backward")
ADAM_LAUNCHES = "one Triton launch, launches"


def adam_launch(kernels: dict, launch: tuple[int, int, int]) -> dict:
    return next(
        x for x in kernels["adam"][ADAM_LAUNCHES] if (x["programs_per_sm"], x["num_warps"], x["block"]) == launch
    )


def adam_fastest(kernels: dict) -> dict:
    return min(kernels["adam"][ADAM_LAUNCHES], key=lambda x: x["step"]["median_ms"])


def adam_folder() -> dict:
    a = ADAM
    out = prefixed("verdict", rule_verdict(a))
    out["runs"] = a.run_table(median=True)
    out["on-top"] = spct(a.tps("with-norm-backward") / a.base - 1)
    out["normbwd-alone"] = spct(NORMBWD.base / NORMBWD.tps("without") - 1)
    losses = [a.json(r)["final_loss"] for r in ADAM_RUNS]
    out["losses-agree"] = sci(max(losses) / min(losses) - 1, 0)
    out["worst-grad-norm"] = f(a.worst_grad_norm(ADAM_RUNS), 3)
    # the GPU test
    gpu = (RESULTS / "adam" / "gpu-test.txt").read_text()
    counts = [tuple(int(x) for x in m) for m in re.findall(r": (\d+) of (\d+) master and moment elements", gpu)]
    if len(counts) != 2 or counts[0][1] != counts[1][1]:
        raise ValueError(f"adam/gpu-test.txt: expected two counts over one element total, found {counts}")
    out["gpu.differ-a"], out["gpu.differ-b"] = n0(counts[0][0]), n0(counts[1][0])
    out["gpu.elements"] = n0(counts[0][1])
    out["gpu.differ-pct"] = pct(counts[0][0] / counts[0][1])
    out["gpu.passed"] = gpu_test("adam")
    # the kernels alone
    k, first_grid = data("adam/kernels.json"), data("adam/kernels-first-grid.json")
    best, first = adam_fastest(k), adam_fastest(first_grid)
    first_launch = (first["programs_per_sm"], first["num_warps"], first["block"])
    again = adam_launch(k, first_launch)
    te = k["adam"][f"chunk {k['adam']['default_chunk_size']}"]

    def launch_words(x: dict) -> str:
        return f"{x['programs_per_sm']} per SM, {x['num_warps']} warps, {x['block']:,} elements"

    rows = {
        "te": (te, None),
        "best": (best["step"], f"**the Triton step, the fastest launch ({launch_words(best)})**"),
        "first": (again["step"], f"the Triton step, the first grid's fastest ({launch_words(first)})"),
    }

    def row(cells: list[str]) -> str:
        return "te" if cells[0].startswith("TE's") else "first" if "first grid" in cells[0] else "best"

    out["alone"] = table(
        row,
        {
            0: lambda key: None if rows[key][1] is None else Whole(rows[key][1]),
            1: lambda key: f(rows[key][0]["median_ms"], 2),
            2: lambda key: n0(rows[key][0]["gb_per_s"]),
        },
    )
    out["first-grid.count"] = str(len(first_grid["adam"][ADAM_LAUNCHES]))
    out["grid.count"] = str(len(k["adam"][ADAM_LAUNCHES]))
    out["first-grid.launch"] = launch_words(first)
    slowest = [x["step"]["median_ms"] for x in k["adam"][ADAM_LAUNCHES] if x["block"] == 2048 and x["num_warps"] == 8]
    out["slowest"] = f"{min(slowest):.1f}-{max(slowest):.1f}"
    beyond = {
        (x["programs_per_sm"], x["block"]): x["step"]["median_ms"]
        for x in data("adam/kernels-beyond.json")["adam"][ADAM_LAUNCHES]
    }
    out["beyond.64"], out["beyond.128"] = f(beyond[(64, 1024)], 2), f(beyond[(128, 1024)], 2)
    out["beyond.32"] = f(beyond[(32, 1024)], 2)
    # the profile
    p = data("adam/profile-shipped.json")
    idle = profile_idle(p)
    out.update(prefixed("profile", {k2: idle[k2] for k2 in ("span", "busy", "idle-ms")}))
    elements = slice_elements()
    adam_s, norm_s = top_kernel(p, "optimizer", "_adam"), top_kernel(p, "optimizer", "L2NormFunctor")
    te_s = top_kernel(data("te-swiglu-backward-and-first-microbatch-writes/profile-shipped.json"), "optimizer",
                      "AdamFunctorMaster")
    gemm = sum(c["seconds_per_step"] for c in p["classes"] if c["class"] in ("grouped expert GEMM", "dense GEMM"))
    out.update(
        {
            "adam-gb": f(elements * ADAM_BYTES / 1e9, 0),
            "slice-b": f(elements / 1e9, 2),
            "te.adam-ms": f(1e3 * te_s, 2),
            "te.adam-tbps": f(elements * ADAM_BYTES / te_s / 1e12, 1),
            "optimizer-ms": class_ms(p, "optimizer", 2),
            "adam-ms": f(1e3 * adam_s, 2),
            "adam-tbps": f(elements * ADAM_BYTES / adam_s / 1e12, 1),
            "l2norm-ms": f(1e3 * norm_s, 2),
            "l2norm-gb": f(elements * NORM_BYTES / 1e9, 1),
            "l2norm-tbps": f(elements * NORM_BYTES / norm_s / 1e12, 1),
            "gemm-ms": f(1e3 * gemm, 1),
            "busy-ms": f(1e3 * p["busy_seconds_per_step"], 1),
        }
    )
    # with Bridge: the sitting of the same lease
    sitting = "2026-12-03-triton-adam"
    runs = runner_runs(sitting)
    _, step53 = target_53(runs[0])
    step = statistics.median(r["step_time_median_s"] for r in runs)
    out["bridge.mfu"] = pct(sitting_mfu(sitting))
    out["bridge.ratio"] = f"{sitting_summary(sitting)['ratio_of_medians']:.3f}x"
    out["bridge.target-step"] = f(step53, 3)
    out["bridge.less-ms"] = f(1e3 * (step - step53), 0)
    return out


NORMBWD = Runs("normbwd", first="with", again="with-again")
NORMBWD_RUNS = ("with", "without", "with-again")
NORM_LAUNCHES = "one Triton pass, launches (backward alone)"
_LAUNCH_WORDS = re.compile(r"(\d+) per SM, (\d+) warps, (\d+) rows?")


def norm_launch_words(x: dict) -> str:
    rows = x["rows_per_iteration"]
    return f"{x['programs_per_sm']} per SM, {x['num_warps']} warps, {rows} row{'s' if rows > 1 else ''}"


def normbwd() -> dict:
    r = NORMBWD
    out = prefixed("verdict", rule_verdict(r))
    out["runs"] = r.run_table(median=True)
    out["gpu.passed"] = gpu_test("normbwd")
    k = data("normbwd/kernels.json")["post_expert_norm"]
    launches = k[NORM_LAUNCHES]
    best = min(launches, key=lambda x: x["backward"]["median_ms"])
    by = {(x["programs_per_sm"], x["num_warps"], x["rows_per_iteration"]): x for x in launches}
    inductor = k["inductor default"]["backward"]
    row_pass, column_sum = list(inductor["kernels_ms"].values())[:2]

    def row(cells: list[str]):
        if cells[0].startswith("TorchInductor"):
            return "inductor"
        if "fastest launch" in cells[0]:
            return "best"
        m = _LAUNCH_WORDS.search(cells[0])
        if not m:
            raise ValueError(f"normbwd/README.md: row {cells[0]!r} names no launch")
        return tuple(int(g) for g in m.groups())

    def first_cell(key):
        if key == "inductor":
            return Whole(
                f"TorchInductor's two kernels (as shipped): row pass {row_pass:.2f} ms + column sum {column_sum:.2f} ms"
            )
        if key == "best":
            return Whole(f"**one pass, the fastest launch ({norm_launch_words(best)})**")
        return None

    def timing(key):
        return inductor if key == "inductor" else (best if key == "best" else by[key])["backward"]

    out["alone"] = table(
        row,
        {0: first_cell, 1: lambda key: f(timing(key)["median_ms"], 2), 2: lambda key: n0(timing(key)["gb_per_s"])},
    )
    for name, values in (
        ("programs", "programs_per_sm"),
        ("warps", "num_warps"),
        ("rows", "rows_per_iteration"),
    ):
        out[f"grid.{name}"] = ", ".join(str(v) for v in sorted({x[values] for x in launches}))
    out["wide-fastest"] = f(min(x["backward"]["median_ms"] for x in launches if x["num_warps"] == 16), 2)
    out["autograd-ms"] = f(k["one Triton pass (norm_backward.py), a candidate"]["backward"]["median_ms"], 2)
    saved = inductor["median_ms"] - best["backward"]["median_ms"]
    out["saved-ms"] = f(saved, 2)
    with_mean = (r.json(r.first)["step_time_mean_s"] + r.json(r.again)["step_time_mean_s"]) / 2
    with_median = (r.median(r.first) + r.median(r.again)) / 2
    out["faster-mean-ms"] = f(1e3 * (r.json("without")["step_time_mean_s"] - with_mean), 1)
    out["faster-median-ms"] = f(1e3 * (r.median("without") - with_median), 1)
    e = embedgrad_verdict()
    out["embedgrad.pair"] = spct(e["pair"])
    out["embedgrad.on-top"] = spct(e["on-top"])
    return out


EMBEDGRAD = Runs("embedgrad", first="with", again="with-again")
EMBEDGRAD_RUNS = ("with", "without", "with-again", "both")


def embedgrad_verdict() -> dict:
    """embedgrad_choose.py's gains: the embedding alone, the pair (both against without), the norm backward on top."""
    e = EMBEDGRAD
    return {
        "alone": e.base / e.tps("without") - 1,
        "pair": e.tps("both") / e.tps("without") - 1,
        "on-top": e.tps("both") / e.base - 1,
    }


def embedgrad() -> dict:
    e = EMBEDGRAD
    v = embedgrad_verdict()
    with_median = (e.median(e.first) + e.median(e.again)) / 2
    peak = {run: e.json(run)["peak_memory_gib"] for run in ("with", "without")}
    losses = [e.json(r)["final_loss"] for r in EMBEDGRAD_RUNS]
    sitting = "2026-12-04"
    return {
        "runs": e.run_table(median=True),
        "gpu.passed": gpu_test("embedgrad"),
        "alone": spct(v["alone"]),
        "pair": spct(v["pair"]),
        "on-top": spct(v["on-top"]),
        "base": n0(e.base),
        "drift": pct(e.drift),
        "twice-drift": pct(2 * e.drift),
        "median.alone": spct(e.median("without") / with_median - 1),
        "median.pair": spct(e.median("without") / e.median("both") - 1),
        "peak.more": f(peak["with"] - peak["without"], 2),
        "peak.with": f(peak["with"], 2),
        "peak.without": f(peak["without"], 2),
        "losses-agree": sci(max(losses) / min(losses) - 1, 0),
        "worst-grad-norm": f(e.worst_grad_norm(EMBEDGRAD_RUNS), 3),
        "normbwd-alone": spct(NORMBWD.base / NORMBWD.tps("without") - 1),
        "bridge.mfu": pct(sitting_mfu(sitting)),
        "bridge.ratio": f"{sitting_summary(sitting)['ratio_of_medians']:.3f}x",
    }



# ---- results/plan-sweep (fit_time.py --sweep's fit, and sittings.py's plan against the side-by-side sittings) -------


def plan_sweep_fit(sub: str) -> dict:
    """One sweep's fit (``fit.json`` of plan-sweep/ or of an earlier sweep's sub-folder): its table of runs, the
    shipped run's errors and the leave-one-out errors over the sweep."""
    folder = f"plan-sweep/{sub + '/' if sub else ''}"
    fit = data(f"{folder}fit.json")
    points = {p["run"]: p for p in fit["points"]}
    shipped = fit["shipped"]
    worst = max(fit["points"], key=lambda p: abs(p["leave_one_out_error"]))
    return {
        "fit": table(
            lambda c: c[0],
            {
                2: lambda run: f(points[run]["measured_s"], 3),
                3: lambda run: f(points[run]["predicted_s"], 3),
                4: lambda run: spct(points[run]["error"], 1),
                5: lambda run: f(points[run]["leave_one_out_predicted_s"], 3),
                6: lambda run: spct(points[run]["leave_one_out_error"], 1),
            },
        ),
        "shipped.measured": f(shipped["measured_s"], 3),
        "shipped.model": f(shipped["predicted_s"], 3),
        "shipped.error": spct(shipped["error"], 1),
        "shipped.leave-one-out": spct(shipped["leave_one_out_error"], 1),
        "leave-one-out.mean": pct(fit["leave_one_out_mean_abs_error"], 1),
        "leave-one-out.max": pct(fit["leave_one_out_max_abs_error"], 1),
        "leave-one-out.worst": worst["run"],
    }


def plan_sweep() -> dict:
    out = plan_sweep_fit("")
    fit = data("plan-sweep/fit.json")
    fitted, held = fit["fitted"], fit["held"]
    out["fitted.efficiency"] = f(fitted["matmul_efficiency"], 4)
    out["held.layer-ms"] = f(1e3 * held["layer_overhead_s"], 3)
    out["held.microbatch-ms"] = f(1e3 * held["microbatch_overhead_s"], 2)
    out["held.expert-us"] = f(1e6 * held["expert_overhead_s"], 2)
    out["held.eager-passes"] = f(held["elementwise_passes"], 3)
    rows = {r["sitting"]: r for r in data("plan-sweep/sittings.json")}

    def sitting(cells: list[str]) -> str:
        return first_code(cells).removeprefix("../side-by-side/").rstrip("/")

    out["sittings"] = table(
        sitting,
        {
            2: lambda s: n0(rows[s]["measured_tokens_per_s_per_gpu"]),
            3: lambda s: n0(rows[s]["planned_tokens_per_s_per_gpu"]),
            4: lambda s: spct(rows[s]["tokens_per_s_error"], 1),
            5: lambda s: f(rows[s]["measured_median_step_s"], 4),
            6: lambda s: f(rows[s]["planned_step_s"], 4),
            7: lambda s: spct(rows[s]["step_error"], 1),
        },
    )
    last = list(rows.values())[-1]
    if not last["shipped_kernels"]:
        raise ValueError("plan-sweep/sittings.json: the last sitting did not run the kernels as shipped")
    out.update(
        {
            "plan.step": f(last["planned_step_s"], 3),
            "plan.tps": n0(last["planned_tokens_per_s_per_gpu"]),
            "plan.tps-error": spct(last["tokens_per_s_error"], 1),
            "plan.step-error": spct(last["step_error"], 1),
            "last.tps": n0(last["measured_tokens_per_s_per_gpu"]),
            "last.step": f(last["measured_median_step_s"], 4),
        }
    )
    return out


def plan_sweep_earlier(sub: str, partial: bool = False) -> Callable[[], dict]:
    """An earlier sweep's figures; a ``partial`` sweep's README also says how many of the runs it reached."""

    def figures() -> dict:
        out = plan_sweep_fit(sub)
        if partial:
            out["ran"] = str(len(data(f"plan-sweep/{sub}/fit.json")["points"]))
        return out

    return figures



# ---- results/plan (fit_time.py's fit to the older H200 runs, and the planner's calibration against them) ----------


def plan_folder() -> dict:
    fit = data("plan/fit_time.json")
    sweep = data("plan-sweep/fit.json")
    points = {p["benchmark"]: p for p in fit["points"]}

    def signed(key: str) -> Callable[[str], str | Whole]:
        """An error column: empty where the run has none (a run no leave-one-out refit could leave out)."""
        return lambda run: Whole("") if points[run].get(key) is None else spct(points[run][key], 1)

    out = {
        "step-times": table(
            lambda c: c[0],
            {
                4: lambda run: f(points[run]["measured_s"], 3),
                5: lambda run: f(points[run]["predicted_s"], 3),
                6: signed("error"),
                7: signed("leave_one_out_error"),
                8: lambda run: f(points[run]["adopted_predicted_s"], 3),
                9: signed("adopted_error"),
                10: signed("adopted_leave_one_out_error"),
            },
        ),
        "refit.loo-mean": pct(fit["leave_one_out_single_gpu_mean_abs_error"], 1),
        "refit.loo-max": pct(fit["leave_one_out_single_gpu_max_abs_error"], 1),
        "refit.efficiency": f(fit["fitted"]["matmul_efficiency"], 4),
        "sweep.efficiency": f(sweep["calibration"]["gemm_efficiency_dense"], 4),
        "sweep.shipped-error": spct(sweep["shipped"]["error"], 1),
        "sweep.shipped-loo": spct(sweep["shipped"]["leave_one_out_error"], 1),
        "sweep.loo-mean": pct(sweep["leave_one_out_mean_abs_error"], 1),
        "sweep.loo-max": pct(sweep["leave_one_out_max_abs_error"], 1),
    }
    # the planner's calibration against these runs, in sample (adopted) and each fitted run left out
    for prefix, errors, groups, with_runs in (
        ("adopted", fit["adopted"], ("fitted_single_gpu", "fitted_all", "checked"), True),
        ("adopted", fit["adopted"], ("proxy_checked", "slice_checked"), False),
        ("left-out", fit["adopted_leave_one_out"], ("fitted_all", "proxy_fitted", "slice_fitted"), True),
    ):
        for group in groups:
            e = errors[group]
            out[f"{prefix}.{group}.mean"] = pct(e["mean_abs_error"], 1)
            out[f"{prefix}.{group}.max"] = pct(e["max_abs_error"], 1)
            if with_runs:
                out[f"{prefix}.{group}.runs"] = str(e["runs"])
    return out


# ---- results/det, ckpt-save, export-roundtrip, peft-lora-slice --------------------------------------------------------


def first_loss(run: str) -> float:
    return lines(f"{run}/metrics.jsonl")[0]["loss"]


def det() -> dict:
    runs = {"deterministic a": "det-a", "deterministic b": "det-b", "default": "default-a"}
    proxy = {name: data(f"det/proxy-1gpu-{run}/results.json") for name, run in runs.items()}
    diff = data("det/proxy-1gpu-default-vs-det.json")["bitwise"]["first_difference"]
    slower = [
        1 - proxy[n]["tokens_per_s_per_gpu"] / proxy["default"]["tokens_per_s_per_gpu"]
        for n in ("deterministic a", "deterministic b")
    ]
    old = {r: data(f"det/before-seed-fix/proxy-1gpu-{r}/results.json") for r in ("det-a", "det-b", "default-a")}
    old_slice = {r: data(f"det/before-seed-fix/slice-1gpu-{r}/results.json") for r in ("det-a", "det-b")}
    sl = {r: data(f"det/slice-1gpu-{r}/results.json") for r in ("det-a", "det-b", "default-a")}
    slice_slower = sorted(
        1 - sl[r]["tokens_per_s_per_gpu"] / sl["default-a"]["tokens_per_s_per_gpu"] for r in ("det-a", "det-b")
    )
    return {
        "proxy": table(
            lambda c: c[0],
            {
                1: lambda n: n0(proxy[n]["tokens_per_s_per_gpu"]),
                2: lambda n: repr(first_loss(f"det/proxy-1gpu-{runs[n]}")),
                3: lambda n: (
                    Whole(
                        f"grad norm differs from step {diff['step']} ({diff['golden']:.7f} vs {diff['candidate']:.7f})"
                    )
                    if n == "default"
                    else None
                ),
            },
        ),
        "proxy-cost": f"{100 * min(slower):.0f}-{100 * max(slower):.0f}%",
        "old.loss-a": f(first_loss("det/before-seed-fix/proxy-1gpu-det-a"), 6),
        "old.loss-b": f(first_loss("det/before-seed-fix/proxy-1gpu-det-b"), 6),
        "old.tps-a": n0(old["det-a"]["tokens_per_s_per_gpu"]),
        "old.tps-b": n0(old["det-b"]["tokens_per_s_per_gpu"]),
        "old.tps-default": n0(old["default-a"]["tokens_per_s_per_gpu"]),
        "old-slice.loss-a": f(first_loss("det/before-seed-fix/slice-1gpu-det-a"), 6),
        "old-slice.loss-b": f(first_loss("det/before-seed-fix/slice-1gpu-det-b"), 6),
        "old-slice.tps-a": n0(old_slice["det-a"]["tokens_per_s_per_gpu"]),
        "old-slice.tps-b": n0(old_slice["det-b"]["tokens_per_s_per_gpu"]),
        "old-slice.mfu-a": pct(old_slice["det-a"]["mfu"], 1),
        "old-slice.mfu-b": pct(old_slice["det-b"]["mfu"], 1),
        "old-slice.peak": f(old_slice["det-a"]["peak_memory_gib"], 2),
        "slice.tps-a": n0(sl["det-a"]["tokens_per_s_per_gpu"]),
        "slice.tps-b": n0(sl["det-b"]["tokens_per_s_per_gpu"]),
        "slice.tps-default": n0(sl["default-a"]["tokens_per_s_per_gpu"]),
        "slice-cost": f"{100 * slice_slower[0]:.1f}-{100 * slice_slower[1]:.1f}%",
        "slice.peak": f(sl["det-a"]["peak_memory_gib"], 2),
        "slice.peak-default": f(sl["default-a"]["peak_memory_gib"], 2),
    }


def ckpt_save() -> dict:
    d = data("ckpt-save/ckpt-save.json")
    base, s, a = d["baseline_step_s"], d["sync"], d["async"]
    rows = {
        "synchronous": {
            1: f(s["blocking_s"], 1),
            2: f(s["complete_s"], 1),
            3: None,
            4: Whole(f"{s['step_time_cost_s']:.1f} s ({s['step_time_cost_s'] / base:.0f} steps)"),
        },
        "asynchronous": {
            1: f(a["blocking_s"], 2),
            2: Whole(f"{a['complete_s']:.1f} s ({a['steps_during_write']} steps later)"),
            3: Whole(
                f"+{1e3 * a['mean_excess_during_write_s']:.1f} ms per step "
                f"(+{100 * a['mean_excess_during_write_s'] / base:.1f}%)"
            ),
            4: Whole(f"{a['step_time_cost_s']:.2f} s ({a['step_time_cost_s'] / base:.1f} steps)"),
        },
    }
    every = 500 * base  # training time between two saves every 500 steps
    return {
        "saves": table(lambda c: c[0], {i: (lambda i: lambda k: rows[k][i])(i) for i in (1, 2, 3, 4)}),
        "baseline": f(base, 3),
        "bytes-gb": f(s["bytes"] / 1e9, 1),
        "bytes-gib": f(s["bytes"] / 2**30, 1),
        "async-blocking": f(a["blocking_s"], 1),
        "async-slower": pct(a["mean_excess_during_write_s"] / base, 1),
        "sync-rate": f(s["bytes"] / s["complete_s"] / 1e9, 2),
        "async-cost": f(a["step_time_cost_s"], 1),
        "less": f"{s['step_time_cost_s'] / a['step_time_cost_s']:.0f}x",
        "peak": f(d["peak_memory_gib"], 2),
        "staged-gib": f(s["bytes"] / 2**30, 0),
        "sync-every-500": pct(s["step_time_cost_s"] / every, 0),
        "async-every-500": pct(a["step_time_cost_s"] / every, 1),
    }


def export_roundtrip() -> dict:
    d = data("export-roundtrip/export-roundtrip.json")
    return {
        "tensors": str(d["tensors_bitwise_equal"]),
        "engine-rms": f(d["logits_rel_rms_engine_bf16_vs_reference_fp32"], 3),
        "reference-rms": f(d["logits_rel_rms_reference_bf16_vs_fp32"], 3),
    }


def peft_slice() -> dict:
    def r(name):
        return data(f"peft-lora-slice/{name}")

    full = data("peft-lora-slice/full/results.json")
    return {
        "table": table(
            first_code,
            {
                1: lambda n: n0(r(n)["tokens_per_s_per_gpu"]),
                2: lambda n: f(r(n)["step_time_mean_s"], 3),
                3: lambda n: pct(r(n)["mfu"], 1),
                4: lambda n: f(r(n)["peak_memory_gib"], 2),
                5: lambda n: f(r(n)["device_memory"]["device_used_gib"], 2),
            },
        ),
        "adapter-gflop": f(r("slice-lora64.json")["flops_per_token"] / 1e9, 2),
        "full-gflop": f(r("slice-full.json")["flops_per_token"] / 1e9, 2),
        "run.first-loss": f(full["first_loss"], 3),
        "run.final-loss": f(full["final_loss"], 3),
        "run.tps": n0(full["tokens_per_s_per_gpu"]),
    }


def parity() -> dict:
    d = data("parity/parity-strict.json")
    eng = d["fp32"]["engine"]
    lg = eng["logits"]
    ratios = d["bf16"]["ratios"]
    return {
        "strict": table(
            lambda c: c[0],
            {
                1: lambda k: f"{lg['distance_vs_fp64']:.2e}" if k.startswith("logits") else None,
                2: lambda k: f"{lg['limit']:.2e}" if k.startswith("logits") else None,
                3: lambda k: (
                    f(lg["ratio"], 2)
                    if k.startswith("logits")
                    else f(eng["gradients_max_ratio"], 2) if k.endswith("gradients (worst)") else None
                ),
                0: lambda k: (
                    Whole(f"{len(eng['gradients'])} gradients (worst)") if k.endswith("gradients (worst)") else None
                ),
            },
        ),
        "bf16.logits": f"{ratios['logits']:.2f}x",
        "bf16.per-token": f"{ratios['per_token_loss']:.2f}x",
        "bf16.loss": f"{ratios['loss']:.2f}x",
        "bf16.factor": f"{d['bf16']['factor']:g}x",
    }


# ---- results/archive/slice-1gpu-mbs4-allgather and -precision-aware -------------------------------------------------


def tps_of(rel: str) -> float:
    return data(rel)["tokens_per_s_per_gpu"]


def gain(a: str, b: str) -> str:
    """+3.5%: the first file's tokens/s against the second's."""
    return spct(tps_of(a) / tps_of(b) - 1, 1)


def file_table(gains: dict, first_cells: dict | None = None) -> Callable[[str], str]:
    """The slice tables: | step | `file` | tokens/s | MFU | step s | peak GiB | gain |, each row's figures from its
    file; ``gains``: file -> the gain cell's figure (or a Whole), ``first_cells``: file -> a Whole step cell."""

    def key(cells):
        return first_code(cells[1:])

    cols = {
        2: lambda rel: n0(tps_of(rel)),
        3: lambda rel: pct(data(rel)["mfu"]),
        4: lambda rel: f(data(rel)["step_time_mean_s"], 3),
        5: lambda rel: f(data(rel)["peak_memory_gib"], 2),
        6: lambda rel: gains.get(rel),
        0: lambda rel: (first_cells or {}).get(rel),
    }
    return table(key, cols)


def memory_in_use(rel: str) -> str:
    mem = data(rel)["device_memory"]
    return f"{mem['device_used_gib']:.1f} of {mem['device_total_gib']:.1f}"


def compare_check(rel: str, name: str) -> float:
    return next(c["value"] for c in data(rel)["convergence"]["checks"] if c["name"] == name)


def remeasured(into: str) -> dict:
    out = {}
    for name in ("proxy-1gpu", "packed-1gpu"):
        now, before = data(f"{into}/{name}/results.json"), data(f"{name}/results.json")
        out[f"{name}.tps"] = n0(now["tokens_per_s_per_gpu"])
        out[f"{name}.committed"] = n0(before["tokens_per_s_per_gpu"])
        out[f"{name}.change"] = spct(now["tokens_per_s_per_gpu"] / before["tokens_per_s_per_gpu"] - 1, 1)
        out[f"{name}.cv"] = f"{now['step_time_cv_percent']:.1f}%"
        out[f"{name}.committed-cv"] = f"{before['step_time_cv_percent']:.1f}%"
    return out


C = "slice-1gpu-candidate-settings"
ALLGATHER = "archive/slice-1gpu-mbs4-allgather/results.json"
PRECISION = "archive/slice-1gpu-mbs4-precision-aware/results.json"


def allgather() -> dict:
    base = f"{C}/lever-base.json"
    mbs4 = f"{C}/lever-mbs4.json"
    ours, peer = data(ALLGATHER), data("bridge/bridge-slice.json")
    gains = {
        base: gain(base, "peft-lora-slice/slice-full.json"),
        ALLGATHER: gain(ALLGATHER, f"{C}/lever-mbs4-allgather.json"),
        "bridge/bridge-slice.json": Whole(f"ours {ours['tokens_per_s_per_gpu'] / peer['tokens_per_s_per_gpu']:.3f}x"),
    }
    for name in ("mbs2", "mbs4", "mbs8"):
        gains[f"{C}/lever-{name}.json"] = gain(f"{C}/lever-{name}.json", base)
    for name in ("mbs4-cutlass", "mbs4-connections8", "mbs4-allgather"):
        gains[f"{C}/lever-{name}.json"] = gain(f"{C}/lever-{name}.json", mbs4)
    mem = data(f"{C}/lever-mbs8.json")["device_memory"]
    log = (RESULTS / C / "cutlass-fallback.log").read_text().splitlines()
    fallbacks = next(int(line.split()[0]) for line in log if "Fallback to cuBLAS" in line)
    strict = data("parity/parity-tp1-loss-chain.json")
    compare = "archive/slice-1gpu-mbs4-allgather/compare-vs-slice-1gpu.json"
    ratio = ours["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"]
    out = {
        "table": file_table(
            gains,
            {f"{C}/lever-mbs8.json": Whole(f"MBS 8, not shipped: {memory_in_use(f'{C}/lever-mbs8.json')} GiB in use")},
        ),
        "fallbacks": str(fallbacks),
        "runner-mbs1": n0(tps_of("slice-1gpu-mbs1-compiled/results.json")),
        "engine-steps-mbs1": n0(tps_of("peft-lora-slice/slice-full.json")),
        "mbs8-free": f(mem["device_total_gib"] - mem["device_used_gib"], 1),
        "loss-curve-r": f(compare_check(compare, "correlation"), 6),
        "final-loss": f(ours["final_loss"], 5),
        "parity-rel": sci(strict["rel_diff_vs_fp32"], 1),
        "parity-steps": sci(round(strict["max_step_loss_rel_diff"], 5), 2),
        "mfu": pct(ours["mfu"]),
        "short": pct(1 - ours["mfu"] / 0.50, 1),
        "shipped-mfu": pct(data(PRECISION)["mfu"]),
        "peer.tps": n0(peer["tokens_per_s_per_gpu"]),
        "peer.mfu": pct(peer["mfu"]),
        "peer.peak": f(peer["peak_memory_gib"], 2),
        "ours.tps": n0(ours["tokens_per_s_per_gpu"]),
        "ours.peak": f(ours["peak_memory_gib"], 2),
        "ratio": f"{ratio:.3f}x",
        "bridge-flops": f(peer["bridge_own_flops_per_token"] / 1e9, 3),
        "our-flops": f(peer["flops_per_token"] / 1e9, 3),
        "bridge-flops-fewer": pct(1 - peer["bridge_own_flops_per_token"] / peer["flops_per_token"]),
    }
    out.update(prefixed("remeasured", remeasured("remeasure")))
    return out


def precision_aware() -> dict:
    lev = f"{C}/lever3-"
    base, swiglu = f"{lev}base.json", f"{lev}swiglu.json"
    run1 = "archive/slice-1gpu-mbs4-precision-aware/run1"
    gains = {
        swiglu: gain(swiglu, base),
        f"{lev}precision-aware.json": gain(f"{lev}precision-aware.json", swiglu),
        f"{lev}mbs8.json": gain(f"{lev}mbs8.json", swiglu),
        f"{lev}precision-aware-fp32.json": gain(f"{lev}precision-aware-fp32.json", swiglu),
        PRECISION: gain(PRECISION, base),
    }
    steps = [r for r in lines(f"{run1}/metrics.jsonl") if "step_time_s" in r]
    slow = max(steps[1:], key=lambda r: r["step_time_s"])
    rest = [r["step_time_s"] for r in steps[1:] if r["step"] != slow["step"]]
    first = data(f"{run1}/results.json")
    shipped, rerun = data(PRECISION), data("det/slice-1gpu-default-a/results.json")
    strict = data("parity/parity-tp1-shipped.json")
    compare = "archive/slice-1gpu-mbs4-precision-aware/compare-vs-slice-1gpu-mbs4.json"
    sizes = {
        n: int((RESULTS / "resume-1gpu-precision-aware" / f"{n}-sizes.txt").read_text().split()[0])
        for n in ("resume1", "fp32-master", "resumeadam")
    }
    prof = data("slice-1gpu-mbs1-compiled/profile-shipped.json")
    secs = {c["class"]: c["seconds_per_step"] for c in prof["classes"]}

    def lists(
        n: int,
    ) -> str:  # multi_tensor_apply over n lists: 5 = FusedAdam's update, 2 = the clip's scale, 1 = the norm
        return f(
            1e3
            * sum(
                s["seconds_per_step"]
                for c in prof["classes"]
                if c["class"] == "optimizer"
                for s in c["top_sites"]
                if f"TensorListMetadata<{n}," in s["kernel"]
            ),
            1,
        )

    d = {r: data(f"det/slice-1gpu-{r}/results.json")["tokens_per_s_per_gpu"] for r in ("det-a", "det-b", "default-a")}
    slower = sorted(1 - d[r] / d["default-a"] for r in ("det-a", "det-b"))
    out = {
        "table": file_table(
            gains,
            {f"{lev}mbs8.json": Whole(f"that at MBS 8, not shipped: {memory_in_use(f'{lev}mbs8.json')} GiB in use")},
        ),
        "step1-loss": f(round(data(base)["steps"][0]["loss"], 5), 5),
        "remainders-save": f(
            data(swiglu)["peak_memory_gib"] - data(f"{lev}precision-aware.json")["peak_memory_gib"], 2
        ),
        "mbs8-in-use": memory_in_use(f"{lev}mbs8.json"),
        "mbs8-mfu": pct(data(f"{lev}mbs8.json")["mfu"]),
        "mbs8-peak": f(data(f"{lev}mbs8.json")["peak_memory_gib"], 2),
        "runner-tps": n0(shipped["tokens_per_s_per_gpu"]),
        "engine-steps-tps": n0(tps_of(f"{lev}precision-aware-fp32.json")),
        "slow-s": f(slow["step_time_s"], 3),
        "slow-step": str(slow["step"]),
        "other-steps": f"{min(rest):.3f}-{max(rest):.3f}",
        "first-mean": f(first["step_time_mean_s"], 3),
        "first-mfu": pct(first["mfu"]),
        "shipped-mfu": pct(shipped["mfu"]),
        "rerun-mfu": pct(rerun["mfu"]),
        "loss-curve-r": f(compare_check(compare, "correlation"), 10),
        "parity-rel": sci(strict["rel_diff_vs_fp32"], 2),
        "parity-steps": sci(strict["max_step_loss_rel_diff"], 2),
        "det.tps-a": n0(d["det-a"]),
        "det.tps-b": n0(d["det-b"]),
        "det.cost": f"{100 * slower[0]:.1f}-{100 * slower[1]:.1f}%",
        "resume1-gb": f(sizes["resume1"] / 1e9, 2),
        "fp32-master-gb": f(sizes["fp32-master"] / 1e9, 2),
        "resumeadam-gb": f(sizes["resumeadam"] / 1e9, 2),
        "resumeadam-r": f(compare_check("resume-1gpu-precision-aware/resumeadam-compare.json", "correlation"), 7),
        "resumeadam-final": sci(compare_check("resume-1gpu-precision-aware/resumeadam-compare.json", "final loss"), 1),
        "profile.step": f(prof["wall_seconds_per_step_profiled"], 3),
        "profile.grouped": f(secs["grouped expert GEMM"], 3),
        "profile.dense": f(secs["dense GEMM"], 3),
        "profile.elementwise": f(secs["norms and elementwise"], 3),
        "profile.optimizer": f(secs["optimizer"], 3),
        "profile.adam": lists(5),
        "profile.clip-scale": lists(2),
        "profile.grad-norm": lists(1),
        "profile.attention": f(secs["attention"], 3),
        "profile.routing": f(secs["router and permutation"], 3),
        "profile.idle": f(prof["idle_seconds_per_step"], 3),
        "peer.tps": n0(tps_of("bridge/bridge-slice.json")),
        "vs-bridge": f"{shipped['tokens_per_s_per_gpu'] / tps_of('bridge/bridge-slice.json'):.3f}x",
        "vs-bridge-then": f"{tps_of(ALLGATHER) / tps_of('bridge/bridge-slice.json'):.3f}x",
    }
    again = remeasured("remeasure/eager-restored")
    out.update(
        prefixed(
            "remeasured",
            {
                k: v
                for k, v in again.items()
                if not k.startswith("proxy-1gpu.") or k.endswith((".tps", ".committed", ".change"))
            },
        )
    )
    return out


def profile_md() -> dict:
    """slice-1gpu-mbs1-compiled/profile.md: each profile's GPU time by class and its share of the kernel time."""
    out = {}
    for name in ("profile", "profile-mbs4", "profile-shipped"):
        p = data(f"slice-1gpu-mbs1-compiled/{name}.json")
        secs = {c["class"]: c["seconds_per_step"] for c in p["classes"]}
        total = sum(secs.values())
        out[name] = table(
            lambda c: c[0],
            {1: lambda k, secs=secs: f(secs[k], 3), 2: lambda k, secs=secs, total=total: pct(secs[k] / total, 1)},
        )
    return out


# ---- the project README and docs/gpu-engine.md -----------------------------------------------------------------------


def project_readme() -> dict:
    manual = [data(f"gc-steady/manual{i}/results.json") for i in (1, 2, 3)]
    out = {
        "shipped-mfu": pct(statistics.median(r["mfu"] for r in manual)),
        "shipped-worst": f(max(r["step_time_worst_ratio"] for r in manual), 3),
        "fp8-mfu": pct(data("fp8-slice/fp8-alltoall/results.json")["mfu"]),
        "fp8-allgather-mfu": pct(data("fp8-allgather/fp8-allgather/results.json")["mfu"]),
        "fp8-300-mfu": pct(data(f"{FP8_CONVERGE}/fp8-allgather-300/results.json")["mfu"]),
    }
    out |= {k: v for k, v in sitting_ratios().items() if k not in ("sitting1.mfu", "sitting2.mfu")}
    out["replay.mfu"] = replay()["isolated.mfu"]
    demo = demo_runs()
    out |= {"demo.reference": demo["reference.final"], "demo.avx2": demo["cpu-avx2.final"],
            "demo.default": demo["cpu-default.final"], "demo.max": demo["cpu-default.max"],
            "demo.compare": demo_transcript()}
    out["bridge-moe.table"] = bridge_moe_table()
    return out


#: docs/gpu-engine.md's GPU table: each row's layout words -> the run it shows
GPU_ENGINE_ROWS = {
    "MBS 1": "proxy-1gpu",
    "EP 2, DP 2, distributed optimizer": "proxy-2gpu",
    "EP 2, `engine_options.compile_elementwise=true`": "proxy-2gpu-compiled",
    "PP 2 (1 + 3 layers), 8 micro-batches": "pp2",
    "CP 2 (a2a)": "cp2",
    "ETP 2, EP 1, dense DP 2": "etp2",
    "packed rows (THD), 1,024-token rows of ~30-token chats": "packed-1gpu",
    "packed rows (THD), CP 2 (a2a), EP 1": "packed-cp2",
    "the recipe as shipped, with the collector by hand (`training.gc`): the median of three runs in one sitting "
    "(`gc-steady/manual1`)": "gc-steady/manual1",
    "the same with `precision: fp8` (tensorwise, hybrid) and the alltoall dispatcher (`fp8-slice/fp8-alltoall`)": "fp8-slice/fp8-alltoall",
    "the recipe as shipped: MBS 4, allgather, chains compiled, precision-aware optimizer, an earlier lease": "archive/slice-1gpu-mbs4-precision-aware",
    "MBS 4, allgather dispatcher (chains compiled; before the precision-aware optimizer), a later lease": "archive/slice-1gpu-mbs4-allgather",
    "MBS 1, alltoall (the recipe before MBS 4; the engine before its last chains)": "slice-1gpu-mbs1-compiled",
    "MBS 2 (compiled)": "slice-1gpu-mbs2-compiled",
    "MBS 1, `engine_options.compile_elementwise=false`": "slice-1gpu-mbs1-eager",
    "MBS 2, `engine_options.compile_elementwise=false`": "slice-1gpu-mbs2-eager",
}


def single_step(results: dict) -> bool:
    """A window of one step has no step-time spread to state."""
    window = results.get("window") or [0, 0]
    return window[1] <= window[0]


def run_columns(first: int, step: bool = False) -> dict[int, Callable[[str], str]]:
    """A runner's figures as the summary tables print them, from column ``first``: tokens/s per GPU, MFU, MFU 6N,
    peak GiB, step-time CV [, mean step s]."""

    def r(run):
        return data(f"{run}/results.json")

    cols = {
        first: lambda run: n0(r(run)["tokens_per_s_per_gpu"]),
        first + 1: lambda run: pct(r(run)["mfu"]),
        first + 2: lambda run: pct(r(run)["mfu_6n"]),
        first + 3: lambda run: f(r(run)["peak_memory_gib"], 2),
        first
        + 4: lambda run: (
            "-"
            if r(run).get("step_time_cv_percent") is None or single_step(r(run))
            else f"{r(run)['step_time_cv_percent']:.1f}%"
        ),
    }
    if step:
        cols[first + 5] = lambda run: f(r(run)["step_time_mean_s"], 3)
    return cols


def gpu_engine_doc() -> dict:
    clip = Runs("clip-skip-and-gated-residual")
    skip = clip.base / clip.tps("te-clip-scale") - 1
    both = clip.tps("shipped-third") / clip.tps("before") - 1
    allgather, converge = fp8_allgather(), fp8_converge()
    return {
        "gpu-table": table(lambda c: GPU_ENGINE_ROWS[c[2]], run_columns(3)),
        "clip.skip": spct(skip),
        "clip.twice-drift": pct(2 * clip.drift),
        "clip.both": spct(both),
    } | {f"fp8-allgather.{k}": allgather[k] for k in ("experts", "fp8.tps", "bf16.tps", "speedup", "fp8.mfu",
                                                         "bf16.mfu", "passed", "verify.equal")} \
        | {f"fp8-300.{k}": converge[k] for k in ("fp8.tps", "bf16.tps", "speedup", "fp8.mfu", "bf16.mfu", "passed",
                                                 "final", "slow.fp8")} | sitting_ratios() \
        | {"mm-profile.elementwise-share": mm_slice_profile_h100()["elementwise-share"]}


def sitting_ratios() -> dict:
    """Each side-by-side sitting's ratio of medians and runner median MFU (the seven H200 sittings by number), and
    the like-for-like sitting's."""
    out = {}
    for i, s in enumerate(SITTINGS):
        out[f"sitting{i + 1}.ratio"] = f"{sitting_summary(s)['ratio_of_medians']:.3f}x"
        out[f"sitting{i + 1}.mfu"] = pct(sitting_mfu(s))
    like = like_for_like()
    return out | {f"like.{k}": like[k] for k in ("ratio", "mfu", "experts")}


# ---- runner tables: gc-steady, fp8-slice, slice-1gpu-b200-set, overhead ---------------------------------------------


def worst_step(r: dict, suffix: str = "") -> Whole:
    """1.011 (step 11): the worst window step over the median, and which step."""
    return Whole(f"{r['step_time_worst_ratio']:.3f}{suffix} (step {r['step_time_worst_step']})")


def gc_steady() -> dict:
    def r(run):
        return data(f"gc-steady/{run}/results.json")

    return {
        "runs": table(
            lambda c: c[0].split()[0],
            {
                1: lambda run: str(r(run)["steps_completed"]),
                2: lambda run: Whole("-".join(map(str, r(run)["window"]))),
                3: lambda run: n0(r(run)["tokens_per_s_per_gpu"]),
                4: lambda run: pct(r(run)["mfu"]),
                5: lambda run: f(r(run)["step_time_mean_s"], 4),
                6: lambda run: f(r(run)["step_time_median_s"], 4),
                7: lambda run: worst_step(r(run)),
                8: lambda run: f"{r(run)['step_time_cv_percent']:.2f}%",
            },
        )
    }


def result_cells(r: Callable[[str], dict], first: int) -> dict:
    """A run table's cells from column ``first`` on, read from each run's results.json (``r(run)``): tokens/s, MFU,
    the mean and median step, the worst window step, the step's CV, the peak memory, the first and final loss."""
    cells = [lambda run: n0(r(run)["tokens_per_s_per_gpu"]), lambda run: pct(r(run)["mfu"]),
             lambda run: f(r(run)["step_time_mean_s"], 4), lambda run: f(r(run)["step_time_median_s"], 4),
             lambda run: worst_step(r(run)), lambda run: f"{r(run)['step_time_cv_percent']:.2f}%",
             lambda run: f(r(run)["peak_memory_gib"], 2), lambda run: f(r(run)["first_loss"], 5),
             lambda run: f(r(run)["final_loss"], 5)]
    return {first + i: cell for i, cell in enumerate(cells)}


def fp8_slice() -> dict:
    def r(run):
        return data(f"fp8-slice/{run}/results.json")

    return {
        "runs": table(
            first_code,
            result_cells(r, 2),
        )
    }


HOST_PROBE = "host-sync-probe"


def host_probe() -> dict:
    """results/host-sync-probe: the whole decoder layer's host time at the smallest token count against the MoE
    block's alone, per model (bf16, EP 8): the layer probe and the MoE probe ran on two lent machines a day apart."""
    moe = {(p["shape"]["model"], p["shape"]["ep"], p["precision"]): p
           for p in data(f"{HOST_PROBE}/host_sync.json")["probes"]}
    rows = []
    for name in ("host_sync_layer.json", "host_sync_layer_models.json"):
        for p in data(f"{HOST_PROBE}/{name}")["probes"]:
            m = moe[(p["shape"]["model"], p["shape"]["ep"], p["precision"])]
            small = min(p["rows"], key=lambda r: r["tokens"])
            larger = sorted(p["rows"], key=lambda r: r["tokens"])[1]
            rows.append(f"| {p['shape']['model']} | {p['shape']['experts']} | {p['host_fwd_s'] * 1e3:.2f} | "
                        f"{m['host_fwd_s'] * 1e3:.2f} | {(p['host_fwd_s'] - m['host_fwd_s']) * 1e3:+.2f} | "
                        f"{p['host_bwd_s'] * 1e3:.2f} | {m['host_bwd_s'] * 1e3:.2f} | "
                        f"{(p['host_bwd_s'] - m['host_bwd_s']) * 1e3:+.2f} | "
                        f"{small['fwd_wall_s'] * 1e3:.2f} at {small['tokens']:,}, {larger['fwd_wall_s'] * 1e3:.2f} "
                        f"at {larger['tokens']:,} |")
    head = ("| model (bf16, EP 8) | local experts | layer fwd (ms) | MoE block fwd (ms) | difference | layer bwd (ms) "
            "| MoE block bwd (ms) | difference | layer fwd wall by tokens (ms) |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---|")
    return {"layer-table": "\n\n" + head + "\n" + "\n".join(rows) + "\n\n"} | layer_gpu_figures()


def layer_gpu_figures() -> dict:
    """results/host-sync-probe: the planner as committed against the whole-layer probes' GPU time
    (scripts/plan/layer_gpu.py), the GPU-bound counts marked."""
    spec = importlib.util.spec_from_file_location("layer_gpu", BENCH / "scripts" / "plan" / "layer_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [r for name in ("host_sync_layer.json", "host_sync_layer_models.json")
            for r in module.compare(data(f"{HOST_PROBE}/{name}"), "H100")]
    bound = [r for r in rows if r["gpu_bound"]]
    lines = [f"| {r['model']} | {r['tokens']:,} | {r['measured_s'] * 1e3:.2f} | {r['planned_s'] * 1e3:.2f} | "
             f"{r['measured_over_planned']:.2f}x | {'GPU' if r['gpu_bound'] else 'host'} |" for r in rows]
    head = ("| model (bf16, EP 8, generic attention) | tokens | measured fwd+bwd, CUDA events (ms) | planned GPU (ms) "
            "| measured / planned | bound by |\n|---|---:|---:|---:|---:|---|")
    return {"layer-gpu-table": "\n\n" + head + "\n" + "\n".join(lines) + "\n\n",
            "layer-gpu.bound-rows": str(len(bound)),
            "layer-gpu.bound-where": ", ".join(f"{r['model']} at {r['tokens']:,} tokens" for r in bound),
            "layer-gpu.bound-ratio": ", ".join(f"{r['measured_over_planned']:.2f}x" for r in bound)}


FP8_ALLGATHER = "fp8-allgather"


def fp8_pair(folder: str, bf16_run: str, fp8_run: str, compare: str) -> dict:
    """bf16 against FP8 on the shipped allgather dispatcher in results/``folder``: the run table, the speed and memory
    figures and ``compare``'s verdict, read from each run's results.json and recipe.yaml and the compare file."""

    def r(run):
        return data(f"{folder}/{run}/results.json")

    bf16, fp8 = r(bf16_run), r(fp8_run)
    cmp = data(f"{folder}/{compare}")
    checks = {c["name"]: c for c in cmp["convergence"]["checks"]}
    recipe = (RESULTS / folder / fp8_run / "recipe.yaml").read_text()
    overrides = re.search(r"num_local_experts: (\d+)", recipe).group(1), re.search(r"num_experts_per_tok: (\d+)",
                                                                                    recipe).group(1)
    return {
        "runs": table(
            first_code,
            result_cells(r, 1),
        ),
        "experts": f"{overrides[0]} experts, top-{overrides[1]}",
        "bf16.tps": n0(bf16["tokens_per_s_per_gpu"]),
        "fp8.tps": n0(fp8["tokens_per_s_per_gpu"]),
        "bf16.mfu": pct(bf16["mfu"], 1),
        "fp8.mfu": pct(fp8["mfu"], 1),
        "peak": n0(fp8["peak_tflops"]),
        "speedup": spct(fp8["tokens_per_s_per_gpu"] / bf16["tokens_per_s_per_gpu"] - 1, 1),
        "tflops": f"{f(bf16['model_tflops_per_gpu'], 1)} -> {f(fp8['model_tflops_per_gpu'], 1)}",
        "memory": f"{cmp['performance']['peak_memory_gib']['delta']:+.2f} GiB",
        "passed": "passed" if cmp["passed"] else "failed",
        "correlation": checks["correlation"]["detail"],
        "pointwise": checks["point-wise tolerance"]["detail"],
        "final": checks["final loss"]["detail"],
        "outliers": checks["3-sigma outliers"]["detail"],
        "first-difference": f"step {cmp['bitwise']['first_difference']['step']}",
        "swiglu": fp8["engine_info"]["experts_swiglu"],
        "diff": f"{cmp['fingerprint_diff']['verdict']}: "
        + ", ".join(f"`{k}`" for k in cmp["fingerprint_diff"]["numerics"]),
        "goal-gap": f"{100 * (0.65 - fp8['mfu']):.1f} points",
        "active": n0(fp8["active_params"]),
    }


def fp8_allgather() -> dict:
    """results/fp8-allgather: bf16 and FP8 on the shipped allgather dispatcher (one H100, the slice cut to fit), their
    compare, and the engine's padded FP8 expert path against megatron-core's expert forward."""
    verify = data(f"{FP8_ALLGATHER}/fp8-experts.json")
    mine, theirs = verify["engine_forward"], verify["megatron_core_forward"]
    return fp8_pair(FP8_ALLGATHER, "bf16-allgather", "fp8-allgather", "compare-bf16-allgather-fp8-allgather.json") | {
        "verify.losses": ", ".join(f(x, 6) for x in mine["losses"]),
        "verify.equal": "equal bit for bit" if (mine["losses"], mine["grad_norms"]) == (theirs["losses"],
                                                                                      theirs["grad_norms"])
        else "not equal",
        "verify.grad": ", ".join(f(x, 4) for x in mine["grad_norms"]),
        "shipped-peak": f(data("fp8-slice/bf16/results.json")["peak_memory_gib"], 2),
    }


FP8_CONVERGE = "fp8-allgather-300"


def fp8_converge() -> dict:
    """results/fp8-allgather-300: the 300-step FP8 run against bf16 on the shipped dispatcher, judged by compare; the
    window's slow steps are the by-hand collections (each step's ``gc_s`` in metrics.jsonl)."""
    pair = fp8_pair(FP8_CONVERGE, "bf16-allgather-300", "fp8-allgather-300", "compare-300-steps.json")
    slow = {}
    for run in ("bf16-allgather-300", "fp8-allgather-300"):
        res = data(f"{FP8_CONVERGE}/{run}/results.json")
        rows = [json.loads(line) for line in (RESULTS / FP8_CONVERGE / run / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        start, end = res["window"]
        median = res["step_time_median_s"]
        over = [x for x in rows if start <= x["step"] <= end and x["step_time_s"] > 1.2 * median]
        collected = [x for x in over if x.get("gc_s", 0) > 0]
        without = [(x["step_time_s"] - x["gc_s"]) / median for x in rows if start <= x["step"] <= end]
        slow[run] = (
            f"{len(over)} window step(s) above 1.2x the median"
            + (f" (steps {', '.join(str(x['step']) for x in over)}, {len(collected)} of them with a by-hand "
               f"collection of {', '.join(f(x['gc_s'], 3) for x in collected)} s)" if over else "")
            + f"; less the collections, the worst step is {max(without):.3f}x the median"
        )
    return pair | {"slow.bf16": slow["bf16-allgather-300"], "slow.fp8": slow["fp8-allgather-300"]}


def b200_set() -> dict:
    def r(run):
        return data(f"slice-1gpu-b200-set/{run}/results.json")

    return {
        "runs": table(
            lambda c: c[0],
            {
                1: lambda run: n0(r(run)["tokens_per_s_per_gpu"]),
                2: lambda run: pct(r(run)["mfu"]),
                3: lambda run: f(r(run)["step_time_median_s"], 4),
                4: lambda run: worst_step(r(run), "x"),
                5: lambda run: f"{r(run)['step_time_cv_percent']:.1f}%",
                6: lambda run: f(r(run)["peak_memory_gib"], 2),
            },
        )
    }


def overhead() -> dict:
    def r(folder):
        return json.loads(next((RESULTS / folder).glob("overhead-*.json")).read_text())

    return {
        "cases": table(
            first_code,
            {
                1: lambda k: f(r(k)["engine_mean_s"], 4),
                2: lambda k: f(r(k)["minimal_mean_s"], 4),
                3: lambda k: spct(r(k)["overhead_percent_mean"] / 100),
                4: lambda k: spct(r(k)["overhead_percent_median"] / 100),
            },
        )
    }


# ---- results/replay ---------------------------------------------------------------------------------------------------


def replay() -> dict:
    """The isolated replay's run, and how far its flash-attn build got."""
    r = data("replay-b200-isolated/results.json")
    done = re.search(
        r"objects compiled: (\d+) of (\d+)", (RESULTS / "replay-b200-isolated" / "fa-unfinished.txt").read_text()
    )
    return {
        "isolated.tps": n0(r["tokens_per_s_per_gpu"]),
        "isolated.mfu": pct(r["mfu"]),
        "isolated.median-step": f(r["step_time_median_s"], 3),
        "isolated.worst": f(r["step_time_worst_ratio"], 3),
        "isolated.cv": f"{r['step_time_cv_percent']:.2f}%",
        "isolated.peak": f(r["peak_memory_gib"], 2),
        "isolated.first-loss": f(r["first_loss"], 4),
        "isolated.final-loss": f(r["final_loss"], 4),
        "fa.compiled": done.group(1),
        "fa.objects": done.group(2),
    }


# ---- docs/input-validation.md ---------------------------------------------------------------------------------------


def secret_detector() -> dict:
    """The secret detector's miss and false-refusal rates on the labelled set (secret-detector-rates/rates.json)."""
    r = data("secret-detector-rates/rates.json")

    def share(n: int, of: int) -> str:
        return f"{n:,} of {of:,} ({100 * n / of:.2f}%)"

    rows = ["| labelled | secrets | missed | non-secrets | refused |", "|---|---:|---:|---:|---:|"]
    for origin, o in [*r["by_origin"].items(), ("all", r)]:
        rows.append(f"| {origin} | {o['secrets']:,} | {share(o['misses'], o['secrets'])} | {o['not_secrets']:,} | "
                    f"{share(o['false_refusals'], o['not_secrets'])} |")
    return {
        "secrets.miss": share(r["misses"], r["secrets"]),
        "secrets.false-refusal": share(r["false_refusals"], r["not_secrets"]),
        "secrets.kinds": f"{sum(1 for k in r['by_kind'].values() if k['secrets'])}",
        "secrets.other-kinds": f"{sum(1 for k in r['by_kind'].values() if k['not_secrets'])}",
        "secrets.table": "\n" + "".join(f"  {row}\n" for row in rows) + "  ",
    }


def images_doc() -> dict:
    """docs/images.md's account of the replays: the isolated replay's set, install, run, parity and flash-attn
    build (the figures ``replay()`` gives its README), and the first replay's MFU on each set."""
    from muse_stack.stack import pylock

    doc, packages = pylock.load(RESULTS / "replay-b200-isolated" / "pylock.b200.toml")
    compiled = set(doc["tool"]["muse-stack"]["sdists"])
    size = sum(a.size for p in packages.values() for a in p.wheels)
    size += sum(p.sdist.size for key, p in packages.items() if key in compiled)
    wheels = re.search(r"installing (\d+) packages", (RESULTS / "replay-b200-isolated" / "install.txt").read_text())
    parity = data("replay-b200-isolated/parity-tp1.json")
    figs = {k: v for k, v in replay().items() if k in ("isolated.tps", "isolated.mfu", "isolated.worst", "fa.compiled",
                                                       "fa.objects")}
    return figs | {
        "isolated.packages": str(len(packages)),
        "isolated.gb": f(size / 1e9, 2),
        "isolated.wheels": wheels.group(1),
        "isolated.parity": sci(parity["rel_diff_vs_fp32"]),
        "first.b200-mfu": pct(data("replay-b200/results.json")["mfu"]),
        "first.h200-mfu": pct(data("replay-h200/results.json")["mfu"]),
    }


# ---- results/demo-tiny-cpu ------------------------------------------------------------------------------------------

DEMO = "demo-tiny-cpu"
#: the demo's runs beside its reference, each the same command with one setting of the CPU changed
DEMO_VARIANTS = ("cpu-avx2", "cpu-default", "one-thread", "mkl-avx2")


def demo_compare(variant: str) -> str:
    """What `muse-stack compare REFERENCE VARIANT --no-plot` prints (a 100-column terminal), from the repository."""
    import os
    import subprocess

    rel = f"benchmarks/results/{DEMO}"
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "muse_stack.cli", "compare", f"{rel}/reference", f"{rel}/{variant}",
                        "--no-plot"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"compare {variant}: exit {r.returncode}: {r.stderr[-2000:]}")
    return "\n".join(line.rstrip() for line in r.stdout.rstrip().splitlines())


def demo_runs() -> dict:
    """Each run's final loss, where its curve first parts from the reference's and how far it gets."""
    from muse_stack.compare.convergence import check_convergence
    from muse_stack.compare.runs import read_metrics

    ref_dir = RESULTS / DEMO / "reference"
    ref = read_metrics(ref_dir)
    ref_loss = {r.step: r.loss for r in ref.steps}
    out = {"reference.final": f(data(f"{DEMO}/reference/results.json")["final_loss"], 4)}
    for v in DEMO_VARIANTS:
        m = read_metrics(RESULTS / DEMO / v)
        loss = {r.step: r.loss for r in m.steps}
        parted = [s for s in sorted(ref_loss) if loss[s] != ref_loss[s]]
        rel = max(abs(loss[s] - ref_loss[s]) / ref_loss[s] for s in ref_loss)
        final = data(f"{DEMO}/{v}/results.json")["final_loss"]
        out[f"{v}.final"] = f(final, 4)
        out[f"{v}.parts"] = f"step {parted[0]}" if parted else "no step (bit-identical)"
        out[f"{v}.max"] = pct(rel)
        out[f"{v}.final-rel"] = pct(abs(final - ref_loss[max(ref_loss)]) / ref_loss[max(ref_loss)])
        out[f"{v}.verdict"] = "passes" if check_convergence(ref, m).passed else "fails"
    return out


def demo_folder() -> dict:
    return demo_runs() | {"compare": "\n```\n" + demo_compare("cpu-avx2") + "\n```\n"}


def demo_transcript() -> str:
    """The README's example: the last lines `compare` prints against the reference for the run made with AVX2
    kernels (its final-loss check, the stack difference and the verdict; the whole output is in the folder's
    README)."""
    lines = demo_compare("cpu-avx2").splitlines()
    final = next(i for i, line in enumerate(lines) if line.startswith("│ final loss"))
    tail = next(i for i, line in enumerate(lines) if line.startswith("stack:"))
    return "\n```\n" + "\n".join(["...", *lines[final:final + 2], "...", *lines[tail:]]) + "\n```\n"


# ---- results/towers-parity-pinned-routing ---------------------------------------------------------------------------


def towers_pinned() -> dict:
    """Each parity run's figures and the towers' bounds (tests/lab/test_benchmarks_megatron.py)."""
    folder = "towers-parity-pinned-routing"
    out: dict = {}
    for run in ("pinned", "defect", "unpinned"):
        d = data(f"{folder}/parity-towers-{run}.json")
        ref = d["logits_rel_rms_reference_bf16_vs_fp32"]
        out[f"{run}.loss"] = sci(d["rel_diff_vs_fp32"])
        out[f"{run}.logits"] = f(d["logits_rel_rms_megatron_vs_fp32"], 4)
        out[f"{run}.ref16"] = f(ref, 4)
        out[f"{run}.ratio"] = f(d["logits_rel_rms_megatron_vs_fp32"] / ref, 2)
        out[f"{run}.features"] = sci(d["image_features_rel_rms_megatron_vs_fp32"])
        steps = d.get("max_step_loss_rel_diff")
        out[f"{run}.steps"] = sci(steps, 2) if steps is not None else "-"
    cpu = data(f"{folder}/cpu-routing.json")
    out["cpu.flips"] = ", ".join(str(n) for n in cpu["unpinned"]["flipped_tokens_by_layer"])
    out["cpu.pinned-flips"] = ", ".join(str(n) for n in cpu["pinned"]["flipped_tokens_by_layer"])
    out["cpu.unpinned"] = f(cpu["unpinned"]["logits_rel_rms_bf16_vs_fp32"], 3)
    out["cpu.perturbed"] = f(cpu["unpinned"]["logits_rel_rms_perturbed_fp32_vs_fp32"], 3)
    out["cpu.pinned"] = f(cpu["pinned"]["logits_rel_rms_bf16_vs_fp32"], 3)
    out["cpu.bound"] = f(2 ** 0.5 * cpu["pinned"]["logits_rel_rms_bf16_vs_fp32"], 3)
    out["cpu.defect"] = f(cpu["pinned"]["defect_logits_rel_rms_bf16_vs_fp32"], 3)
    out["cpu.machine"] = f"{cpu['cpu_capability']}, {cpu['threads']} threads, torch {cpu['torch']}"
    trained = cpu["trained"]["variants"]
    spread = max(max(v["loss_rel_diff_vs_fp32"]) for v in trained.values())
    out["cpu.trained.variants"] = str(len(trained))
    out["cpu.trained.spread"] = sci(spread, 2)
    out["cpu.trained.bound"] = sci(2 ** 0.5 * spread, 2)
    out["cpu.trained.logits1"] = f(trained["bf16"]["after"][0]["logits_rel_rms_vs_fp32"], 3)
    out["cpu.trained.logits2"] = f(trained["bf16"]["after"][1]["logits_rel_rms_vs_fp32"], 3)
    out["cpu.trained.twice"] = f(max(a["logits_rel_rms_vs_fp32"] / b["logits_rel_rms_vs_fp32"] for a, b in
                                     zip(trained["bf16-twice"]["after"], trained["bf16"]["after"])), 2)
    fp32 = cpu["trained"]["fp32_losses"]
    out["cpu.trained.drop-fp32"] = f(fp32[0] - fp32[1], 4)
    out["cpu.trained.drop-bf16"] = f(trained["bf16"]["losses"][0] - trained["bf16"]["losses"][1], 4)
    second = [v["losses"][1] for v in trained.values()]
    out["cpu.trained.step2"] = f"{f(min(second), 4)} to {f(max(second), 4)}"
    pinned = data(f"{folder}/parity-towers-pinned.json")
    for key, losses in (("engine", "megatron_step_losses"), ("bf16", "reference_step_losses"),
                        ("fp32", "reference_fp32_step_losses")):
        out[f"pinned.losses.{key}"] = ", ".join(f(x, 5) for x in pinned[losses])
        out[f"pinned.drop.{key}"] = f(pinned[losses][0] - pinned[losses][1], 4)
    out["pinned.steps-fp32"] = sci(max(abs(m - r) / r for m, r in zip(pinned["megatron_step_losses"],
                                                                      pinned["reference_fp32_step_losses"])), 2)
    out["pinned.after-ratios"] = " and ".join(
        f(a["logits_rel_rms_megatron_vs_fp32"] / a["logits_rel_rms_reference_bf16_vs_fp32"], 2)
        for a in pinned["logits_after_steps"])
    return out


#: docs/planning.md's example of the towers' stage: the recipe and the overrides its text names
PLANNING_TOWERS = ("sft-192-mm", ["batch.mbs=1", "batch.gbs=384", "batch.seq_length=4096"])


def planning_towers() -> dict:
    """docs/planning.md's towers stage: what the planner as committed puts on stage 0 of its example."""
    from muse_stack.plan.planner import make_plan
    from muse_stack.recipes.catalogue import load_recipe

    name, overrides = PLANNING_TOWERS
    out = {}
    for key, extra in (("", []), ("bf16-", ["engine_options.towers_bf16_activations=true"])):
        plan, _ = make_plan(load_recipe(name, [*overrides, *extra]), strict=False)
        stage = plan.memory[0]
        out |= {f"towers.{key}stage0-gib": f"{stage.total_gib:.1f}",
                f"towers.{key}fits": "fits" if plan.fits else "does not fit"}
        if not key:
            out["towers.stage0-params"] = f"{stage.params / 1e9:.2f}B"
            out["towers.limit"] = f"{plan.gpu_memory_gib * (1 - plan.calibration.headroom_fraction):.1f}"
    return out


def planning_record() -> dict:
    """docs/planning.md's figures of the B200 record out of sample (results/plan/validate.json)."""
    v = data("plan/validate.json")
    out: dict = {}
    for key in ("tuned", "untuned"):
        out[f"record.{key}.pred"] = f(v[key]["tokens_per_s_per_gpu"], 1)
        out[f"record.{key}.meas"] = str(v[key]["measured"])
        out[f"record.{key}.err"] = f"{v[key]['error']:+.1%}"
        out[f"record.{key}.dom"] = v[key]["dominant"]
    out["record.ratio.pred"] = f(v["ratio"]["predicted"], 2)
    out["record.ratio.meas"] = f(v["ratio"]["measured"], 2)
    out["record.ratio.err"] = f"{v['ratio']['error']:+.1%}"
    out["record.ratio.high"] = pct(v["ratio"]["error"], 1)
    t, best = v["tune"], v["tune"]["best"][0]
    out["record.tune.planned"] = n0(t["planned"])
    out["record.tune.seconds"] = f(t["seconds"], 1)
    out["record.tune.best"] = best["label"]
    out["record.tune.tps"] = f(best["tokens_per_s_per_gpu"], 1)
    out["record.tune.used"] = f(best["used_gib"], 1)
    out["record.tune.dom"] = best["dominant"]
    out["record.tune.gain"] = f"{t['gain_over_own_prediction']:+.1%}"
    return out


# ---- results/mm-slice-profile-h100 (slice-1gpu-mm cut to fit an H100: a profile, a run, and the plan) ------------

MM_H100 = "mm-slice-profile-h100"
#: launch sites listed in the README's table, the largest first
MM_SITES = 10


def profiled_steps(p: dict) -> int:
    """The steps a profile_step.py profile covers (its method says "..., then N steps under torch.profiler")."""
    m = re.search(r"then (\d+) steps? under torch\.profiler", p["method"])
    if not m:
        raise ValueError(f"the profile's method {p['method']!r} does not say how many steps it profiled")
    return int(m.group(1))


def short_operators(ops: str, keep: int = 3) -> str:
    """A launch site's innermost ``keep`` operators, each shape list with a run of equal shapes written once and
    counted ("f[[3,16,96],[3,16,96],[3,16]]" -> "f[[3,16,96] x2,[3,16]]")."""

    def collapse(m: re.Match) -> str:
        shapes = re.findall(r"\[[^\[\]]*\]", m.group(0)[1:-1])
        out: list[list] = []
        for shape in shapes:
            if out and out[-1][0] == shape:
                out[-1][1] += 1
            else:
                out.append([shape, 1])
        return "[" + ",".join(sh + (f" x{n}" if n > 1 else "") for sh, n in out) + "]"

    return " > ".join(re.sub(r"\[(?:\[[^\[\]]*\],?)+\]", collapse, op) for op in ops.split(" > ")[-keep:])


def mm_h100_plans() -> tuple:
    """The plan for the run's recipe as it ran (run/recipe.yaml), and for the same recipe with 8 experts (the first
    attempt), by the planner as committed; the towers' memory traffic per step that plan prices."""
    import yaml

    from muse_stack.machine.hardware import gpu_spec
    from muse_stack.plan.cost import tower_elementwise_time
    from muse_stack.plan.planner import make_plan
    from muse_stack.plan.towers import tower_plan
    from muse_stack.recipes.catalogue import load_recipe
    from muse_stack.recipes.overrides import parse_override
    from muse_stack.resolve.recipe import finalize

    path = RESULTS / MM_H100 / "run" / "recipe.yaml"
    ran = yaml.safe_load(path.read_text())
    for text in data(f"{MM_H100}/profile.json")["overrides"]:  # the profile ran the shape the run ran
        keys, value = parse_override(text)
        node = ran
        for key in keys:
            node = node[key]
        if node != value:
            raise ValueError(f"{MM_H100}: the profile ran {text}, run/recipe.yaml has {node!r}: not one shape")
    resolved = finalize(load_recipe(str(path)))
    plan, _ = make_plan(resolved)
    eight, _ = make_plan(finalize(load_recipe(str(path), ["model.overrides.num_local_experts=8"])))
    recipe = resolved.recipe
    traffic = plan.time.microbatches * tower_elementwise_time(
        tower_plan(resolved), gpu_spec(recipe.hardware.gpu), sequences=recipe.batch.mbs,
        recomputed=recipe.recompute_towers())
    return plan, eight, traffic


def mm_slice_profile_h100() -> dict:
    """results/mm-slice-profile-h100: the profile's time by class, idle gaps, largest kernels and launch sites; the
    run against the plan for its recipe; the plan's terms beside the profile's classes; the first attempt (8
    experts) and the shipped shape's H200 figures it is not comparable with."""
    p = data(f"{MM_H100}/profile.json")
    run = data(f"{MM_H100}/run/results.json")
    plan, eight, traffic = mm_h100_plans()
    t = plan.time
    secs = {c["class"]: c["seconds_per_step"] for c in p["classes"]}
    shares = {c["class"]: c["share_of_kernel_time"] for c in p["classes"]}
    steps = profiled_steps(p)
    out: dict = {
        "classes": table(lambda c: c[0], {1: lambda k: f(secs[k], 3), 2: lambda k: pct(shares[k], 1)}),
        "kernel-s": f(p["kernel_seconds_per_step"], 2),
        "elementwise-s": f(secs["norms and elementwise"], 2),
        "elementwise-share": pct(shares["norms and elementwise"], 0),
        "dense-s": f(secs["dense GEMM"], 2),
        "attention-s": f(secs["attention"], 2),
        "router-ms": f(1e3 * secs["router and permutation"], 1),
        "kernels": n0(p["kernels"] / steps),
        "profiled-steps": str(steps),
        "wall-s": f(p["wall_seconds_per_step_profiled"], 2),
    }
    idle = profile_idle(p)
    out.update(prefixed("idle", {k: idle[k] for k in ("span", "busy", "idle-ms", "idle-pct", "short-ms", "short-count",
                                                      "mid-ms", "mid-count", "long-ms", "long-count")}))
    out["idle-s"] = f(p["idle_seconds_per_step"], 2)
    gaps = p["longest_gaps"]
    first = gaps[0]
    out["gap.ms"] = f(1e3 * first["seconds"], 1)
    out["gap.at"] = f(first["at_s"], 2)
    out["gap.span"] = f(steps * p["span_seconds_per_step"], 2)
    out["gap.call-share"] = pct(first["runtime_call_share"], 2)
    grouped = [g["seconds"] for g in gaps if "_GroupedLinear" in g["operators"]]
    out["gap.grouped-linear"] = str(len(grouped))
    out["gap.grouped-linear-ms"] = f"{1e3 * min(grouped):.1f}-{1e3 * max(grouped):.1f}"
    out["gap.listed"] = str(len(gaps))
    blocked = p["idle_after_blocking_calls"]
    out["blocked-count"] = f"{blocked['count_per_step']:g}"
    out["blocked-ms"] = f(1e3 * blocked["seconds_per_step"], 2)
    # the elementwise class's largest kernels: the README names each by a part of its name
    ew = next(c for c in p["classes"] if c["class"] == "norms and elementwise")
    attn = next(c for c in p["classes"] if c["class"] == "attention")

    def top_ms(cls: dict) -> Callable[[str], str]:
        def ms(key: str) -> str:
            hits = [v for name, v in cls["top_kernels"] if key in name]
            if len(hits) != 1:
                raise ValueError(f"{MM_H100}: {len(hits)} top kernels of {cls['class']} hold {key!r}")
            return f(1e3 * hits[0], 1)

        return ms

    out["elementwise-kernels"] = table(first_code, {1: top_ms(ew)})
    copies = sum(v for name, v in ew["top_kernels"] if "copy_kernel" in name)
    out["copies-ms"] = f(1e3 * copies, 0)
    out["copies-share"] = pct(copies / secs["norms and elementwise"], 0)
    top5 = sum(v for _, v in ew["top_kernels"])
    out["top5-ms"] = n0(1e3 * top5)
    out["top5-share"] = pct(top5 / secs["norms and elementwise"], 0)
    out["attention-kernels"] = table(first_code, {1: top_ms(attn)})
    router = next(c for c in p["classes"] if c["class"] == "router and permutation")
    out["router.sites"] = str(len(router["top_sites"]))
    out["router.gather-sites"] = str(sum("IndexBackward0" in s["operators"] for s in router["top_sites"]))
    out["router.gather-ms"] = f(1e3 * site_ms(router, "IndexBackward0"), 1)
    ran = (RESULTS / MM_H100 / "run" / "recipe.yaml").read_text()
    experts = re.search(r"num_local_experts: (\d+)", ran).group(1)
    top = re.search(r"num_experts_per_tok: (\d+)", ran).group(1)
    out["experts"] = f"{experts} experts, top-{top}"
    # the largest launch sites of every class, the largest first
    sites = sorted(((s, c["class"]) for c in p["classes"] for s in c["top_sites"]),
                   key=lambda x: -x[0]["seconds_per_step"])
    if len(sites) < MM_SITES:
        raise ValueError(f"{MM_H100}: the profile lists {len(sites)} launch sites, fewer than {MM_SITES}")

    def site(i: str) -> tuple[dict, str]:
        return sites[int(i) - 1]

    out["sites"] = table(
        lambda c: c[0],
        {
            1: lambda i: f(1e3 * site(i)[0]["seconds_per_step"], 1),
            2: lambda i: Whole(site(i)[1]),
            3: lambda i: Whole(f"`{site(i)[0]['kernel'].removeprefix('void ')}`"),
            4: lambda i: Whole(f"`{short_operators(site(i)[0]['operators'])}`" if site(i)[0]["operators"]
                               else "none open"),
        },
    )
    out["sites.count"] = str(MM_SITES)
    # the run, against the plan for its recipe
    mem = run["device_memory"]
    flops = run["flops_per_token"]
    out.update({
        "run.tps": n0(run["tokens_per_s_per_gpu"]),
        "run.mfu": pct(run["mfu"], 1),
        "run.peak-tflops": n0(run["peak_tflops"]),
        "run.gflop": f(flops["training"] / 1e9, 1),
        "run.towers-gflop": f(flops["towers_training"] / 1e9, 1),
        "run.median": f(run["step_time_median_s"], 3),
        "run.mean": f(run["step_time_mean_s"], 3),
        "run.worst": f(run["step_time_worst_ratio"], 2),
        "run.worst-step": str(run["step_time_worst_step"]),
        "run.cv": f"{run['step_time_cv_percent']:.1f}%",
        "run.peak": f(run["peak_memory_gib"], 2),
        "run.used": f(mem["device_used_gib"], 2),
        "run.total": f(mem["device_total_gib"], 2),
        "run.first-loss": f(run["first_loss"], 3),
        "run.final-loss": f(run["final_loss"], 3),
        "run.window": "-".join(map(str, run["window"])),
        "profile-over-run": spct(p["wall_seconds_per_step_profiled"] / run["step_time_median_s"] - 1, 1),
        "plan.tps": n0(t.tokens_per_s_per_gpu),
        "plan.step": f(t.step_s, 3),
        "plan.peak": f(plan.peak_memory_gib, 2),
        "plan.used": f(plan.used.used_gib, 2),
        "plan.gpu": f(plan.gpu_memory_gib, 2),
        "plan.dominant": t.dominant,
        "vs.tps": spct(run["tokens_per_s_per_gpu"] / t.tokens_per_s_per_gpu - 1, 1),
        "vs.step": spct(run["step_time_median_s"] / t.step_s - 1, 1),
        "vs.peak": spct(run["peak_memory_gib"] / plan.peak_memory_gib - 1, 1),
        "vs.used": spct(mem["device_used_gib"] / plan.used.used_gib - 1, 1),
        "eight.peak": f(eight.peak_memory_gib, 1),
        "eight.limit": f(eight.gpu_memory_gib * (1 - eight.calibration.headroom_fraction), 1),
        "eight.gpu": f(eight.gpu_memory_gib, 1),
        "eight.fits": "fits" if eight.fits else "does not fit",
        "eight.headroom": pct(eight.calibration.headroom_fraction, 0),
    })
    # the plan's terms beside the profile's classes
    terms = dict(t.terms_s)
    towers = terms.pop("towers")
    priced = {
        "GEMMs and attention": terms.pop("dense_gemm") + terms.pop("attention") + towers - traffic,
        "memory-bound passes": terms.pop("elementwise") + traffic,
        "experts' grouped GEMM": terms.pop("expert_gemm"),
        "optimizer": terms.pop("optimizer"),
        "GPU idle": terms.pop("host_exposed"),
        "the step": t.step_s,
    }
    if any(v for v in terms.values()):
        raise ValueError(f"{MM_H100}: the plan prices terms the README's table lacks: {terms}")
    measured = {
        "GEMMs and attention": secs["dense GEMM"] + secs["attention"],
        "memory-bound passes": secs["norms and elementwise"] + secs["router and permutation"] + secs["loss"],
        "experts' grouped GEMM": secs["grouped expert GEMM"],
        "optimizer": secs["optimizer"] + secs["communication"],
        "GPU idle": p["idle_seconds_per_step"],
        "the step": p["span_seconds_per_step"],
    }
    out["terms"] = table(lambda c: c[0].strip("*"), {1: lambda k: f(priced[k], 3), 2: lambda k: f(measured[k], 3)})
    out["plan.traffic"] = f(traffic, 2)
    out["plan.towers"] = f(towers, 2)
    # the first attempt, and the shipped shape on an H200
    oom = re.search(r"([\d.]+) GiB is allocated by PyTorch", (RESULTS / MM_H100 / "8-experts-profile.log").read_text())
    out["eight.oom-allocated"] = oom.group(1)
    h200 = data("mm-slice/grouped-attention/results.json")
    out["h200.mfu"] = pct(h200["mfu"], 1)
    out["h200.peak"] = f(h200["peak_memory_gib"], 2)
    out["h200.first-peak"] = f(data("mm-slice/results.json")["peak_memory_gib"], 2)
    # the planner as committed on that H200 run's recipe: a shape and card its memory model was not set on here
    from muse_stack.plan.planner import make_plan
    from muse_stack.recipes.catalogue import load_recipe

    h200_plan, _ = make_plan(load_recipe(str(RESULTS / "mm-slice" / "grouped-attention" / "recipe.yaml")),
                             strict=False)
    out["h200.plan-peak"] = f(h200_plan.peak_memory_gib, 2)
    out["h200.vs-peak"] = spct(h200["peak_memory_gib"] / h200_plan.peak_memory_gib - 1, 1)
    out["h200.plan-step"] = f(h200_plan.time.step_s, 3)
    out["h200.median"] = f(h200["step_time_median_s"], 3)
    out["h200.vs-step"] = spct(h200["step_time_median_s"] / h200_plan.time.step_s - 1, 1)
    return out


# ---- benchmarks/README.md ---------------------------------------------------------------------------------------------


def benchmarks_readme() -> dict:
    """The main table: per run, tokens/s per GPU, MFU, MFU 6N, peak GiB, step-time CV and mean step."""
    return {"summary": table(first_code, run_columns(3, step=True))}


# ---- benchmarks/index.yaml ------------------------------------------------------------------------------------------


def index_results() -> str:
    """benchmarks/index.yaml's list of result folders, from each folder's result.json."""
    out = []
    for folder in schema.result_folders(RESULTS):
        r = schema.load(folder)
        command = next((c for c in r.commands), "")
        out.append(
            f"  - path: results/{r.id}\n"
            f"    claim: {json.dumps(r.claim)}\n"
            f"    status: {r.status}\n"
            f"    date: {json.dumps(r.date)}\n"
            f"    hardware: {json.dumps(r.hardware)}\n"
            f"    command: {json.dumps(command)}\n"
        )
    return "".join(out)


def index() -> dict:
    return {"results": index_results()}


# ---- the planner at scale against Megatron-Bridge's published MoE runs (results/bridge-moe-validation) ----------


BRIDGE = "bridge-moe-validation/validation.json"
#: the first result: every row priced with the page's printed columns (superseded by the run settings)
BRIDGE_FIRST = "archive/bridge-moe-validation-printed-layouts/validation.json"
#: the result before the third amendment: every run's host time the fitted forward figure (superseded by the
#: measured host time of the runs without CUDA graphs)
BRIDGE_SECOND = "archive/bridge-moe-validation-forward-host-gap/validation.json"


def bridge_summary(v: dict, prefix: str) -> dict:
    """A validation.json's validation errors: overall and by generation."""
    out = {f"{prefix}.median": pct(v["validation"]["median_abs_error"], 1),
           f"{prefix}.max": pct(v["validation"]["max_abs_error"], 1),
           f"{prefix}.within": str(v["validation"]["within_max"]), f"{prefix}.rows": str(v["validation"]["rows"])}
    for gen, g in v["by_generation"].items():
        out[f"{prefix}.{gen}"] = pct(g["median_abs_error"], 1)
    return out


def bridge_moe_folder() -> dict:
    v = data(BRIDGE)
    out = bridge_summary(v, "bridge") | bridge_summary(data(BRIDGE_FIRST), "first") \
        | bridge_summary(data(BRIDGE_SECOND), "second")
    fit, first_fit = data("bridge-moe-validation/fit.json"), data("archive/bridge-moe-validation-printed-layouts/fit.json")
    out |= {"fit.efficiency": f(fit["gemm_efficiency_sm100"], 3), "fit.gap_ms": f(1e3 * fit["moe_sync_gap_s"], 1),
            "first.efficiency": f(first_fit["gemm_efficiency_sm100"], 3),
            "first.gap_ms": f(1e3 * first_fit["moe_sync_gap_s"], 1),
            "bridge.unfit": ", ".join(r["id"] for r in v["rows"] if not r["fits"]) or "none",
            "bridge-moe.moved": bridge_moe_moved(v, data(BRIDGE_FIRST), data(BRIDGE_SECOND))}
    for name in ("tuned", "untuned"):
        r = v["record"][name]
        host = r["host_sync_at_scale"]
        out |= {f"record.{name}.predicted": n0(r["predicted_tokens_per_s_per_gpu"]),
                f"record.{name}.measured": n0(r["measured_tokens_per_s_per_gpu"]),
                f"record.{name}.host": f(host["added_s"], 2),
                f"record.{name}.fwd_ms": f(1e3 * host["moe_layer_forward_gpu_s"], 1),
                f"record.{name}.gap": f(r["gap_s"], 2)}
    tuned = v["record"]["tuned"]
    out |= {"record.tuned.step": f(tuned["predicted_step_s"], 2),
            "record.tuned.measured_step": f(tuned["measured_step_s"], 2),
            "record.tuned.bubble": f(tuned["terms_s"]["pp_bubble"], 2),
            "record.tuned.predicted2": n0(tuned["predicted_tokens_per_s_per_gpu"])}
    b200 = [r["error"] for r in v["rows"] if r["gpu"] == "B200" and r["role"] == "validation"]
    gb200 = [abs(r["error"]) for r in v["rows"] if r["gpu"] == "GB200" and r["role"] == "validation"]
    out |= {"record.b200_min": spct(min(b200), 1), "record.b200_max": spct(max(b200), 1),
            "record.gb200_max": pct(max(gb200), 1)}
    return out


def bridge_run_differs(r: dict) -> str:
    """What the planner prices differently for a row than the page's columns alone: the layout fields the run
    changes, and its recompute and parameter gather."""
    parts = [f"{k.upper()} {c['run']} (page {c['page']})" for k, c in r["page_differs"].items()]
    s = r["run_settings"]
    parts.append(f"recompute {', '.join(s['recompute'])}" if s["recompute"] else "no recompute")
    if not s["overlap_param_gather"]:
        parts.append("parameter gather exposed")
    return "; ".join(parts)


def bridge_moe_moved(v: dict, first: dict, second: dict) -> str:
    """The folder README's table: each row's error with the page's columns (the first result), as it ran with the
    fitted forward host figure for every run (the second), and now, and what the run's settings change."""
    before = {r["id"]: r for r in first["rows"]}
    fitted = {r["id"]: r for r in second["rows"]}
    head = ("| run | role | priced as it ran | dispatcher; CUDA graphs; A2A overlap | error, page's "
            "columns | error, as it ran, fitted host | error, host measured where ungraphed |"
            "\n|---|---|---|---|---:|---:|---:|\n")
    body = []
    for r in v["rows"]:
        s = r["run_settings"]
        stated = (f"{s['dispatcher']}; {', '.join(s['cuda_graphs']) or 'none'}; "
                  f"{'on' if s['a2a_overlap'] else 'off'}")
        body.append(f"| {r['id']} | {r['role']} | {bridge_run_differs(r)} | {stated} | "
                    f"{spct(before[r['id']]['error'], 1)} | {spct(fitted[r['id']]['error'], 1)} | "
                    f"{spct(r['error'], 1)} |")
    return "\n\n" + head + "\n".join(body) + "\n\n"


def bridge_moe_table() -> str:
    """The README's one-screen table: every published row as it ran, its prediction, error and role; the summary
    line, and the first result's beside it."""
    v = data(BRIDGE)
    head = ("| run | GPUs | layout as it ran | published | predicted | error | role | the run's layout's rank in "
            "tune |\n|---|---:|---|---:|---:|---:|---|---|\n")
    body = []
    for r in v["rows"]:
        lay = r["layout"]
        layout = (f"{r['precision']} TP{lay['tp']} PP{lay['pp']} VP{lay['vp']} EP{lay['ep']} MBS{lay['mbs']}")
        page = [f"{k.upper()}{c['page']}" for k, c in r["page_differs"].items() if k != "ga"]
        if page:
            layout += f" (page: {' '.join(page)})"
        t = r.get("tune")
        rank = f"{t['published_rank']} of {t['layouts']}" if t else "-"
        body.append(f"| {r['id']} | {lay['gpus']} | {layout} | {n0(r['published_tokens_per_s_per_gpu'])} | "
                    f"{n0(r['predicted_tokens_per_s_per_gpu'])} | {spct(r['error'], 1)} | {r['role']} | {rank} |")
    val, first, second = v["validation"], data(BRIDGE_FIRST)["validation"], data(BRIDGE_SECOND)["validation"]
    gens = ", ".join(f"{g} {pct(x['median_abs_error'], 1)}" for g, x in v["by_generation"].items())
    tail = (f"\nValidation ({val['rows']} rows): median |error| {pct(val['median_abs_error'], 1)} (goal "
            f"{pct(val['goal_median'], 0)}), max {pct(val['max_abs_error'], 1)} (goal {pct(val['goal_max'], 0)}); "
            f"median by generation: {gens}; every published layout predicted to fit: "
            f"{'yes' if val['all_fit_in_memory'] else 'no'}. With the page's columns alone (the first result, "
            f"before the protocol's first amendment): median {pct(first['median_abs_error'], 1)}, max "
            f"{pct(first['max_abs_error'], 1)}; with one fitted host figure for every run (before the third): median "
            f"{pct(second['median_abs_error'], 1)}, max {pct(second['max_abs_error'], 1)}.\n")
    return "\n\n" + head + "\n".join(body) + "\n" + tail + "\n"


def bridge_moe_first() -> dict:
    """The archived first result's README: its own errors."""
    return bridge_summary(data(BRIDGE_FIRST), "first")


def bridge_moe_second() -> dict:
    """The archived result before the third amendment: its own errors."""
    return bridge_summary(data(BRIDGE_SECOND), "second")


DOCS: dict[str, Callable[[], dict]] = {
    "benchmarks/index.yaml": index,
    "benchmarks/results/engine-options-each-alone/README.md": engine_options,
    "benchmarks/results/side-by-side/README.md": side_by_side,
    "README.md": project_readme,
    "docs/gpu-engine.md": gpu_engine_doc,
    "benchmarks/results/clip-skip-and-gated-residual/README.md": clip_skip,
    "benchmarks/results/expert-gemm/README.md": expert_gemm,
    "benchmarks/results/early-expert-counts-and-pre-mlp-norm/README.md": early_counts,
    "benchmarks/results/te-swiglu-backward-and-first-microbatch-writes/README.md": te_swiglu,
    "benchmarks/results/det/README.md": det,
    "benchmarks/results/ckpt-save/README.md": ckpt_save,
    "benchmarks/results/export-roundtrip/README.md": export_roundtrip,
    "benchmarks/results/peft-lora-slice/README.md": peft_slice,
    "benchmarks/results/parity/README.md": parity,
    "benchmarks/results/archive/slice-1gpu-mbs4-allgather/README.md": allgather,
    "benchmarks/results/archive/slice-1gpu-mbs4-precision-aware/README.md": precision_aware,
    "benchmarks/results/slice-1gpu-mbs1-compiled/profile.md": profile_md,
    "benchmarks/README.md": benchmarks_readme,
    "benchmarks/results/replay/README.md": replay,
    "docs/images.md": images_doc,
    "benchmarks/results/demo-tiny-cpu/README.md": demo_folder,
    "benchmarks/results/towers-parity-pinned-routing/README.md": towers_pinned,
    "benchmarks/results/mm-slice-profile-h100/README.md": mm_slice_profile_h100,
    "benchmarks/results/gc-steady/README.md": gc_steady,
    "benchmarks/results/fp8-slice/README.md": fp8_slice,
    "benchmarks/results/fp8-allgather/README.md": fp8_allgather,
    "benchmarks/results/fp8-allgather-300/README.md": fp8_converge,
    "benchmarks/results/host-sync-probe/README.md": host_probe,
    "benchmarks/results/slice-1gpu-b200-set/README.md": b200_set,
    "benchmarks/results/overhead/README.md": overhead,
    "benchmarks/results/adam/README.md": adam_folder,
    "benchmarks/results/normbwd/README.md": normbwd,
    "benchmarks/results/embedgrad/README.md": embedgrad,
    "benchmarks/results/plan/README.md": plan_folder,
    "benchmarks/results/bridge-moe-validation/README.md": bridge_moe_folder,
    "benchmarks/results/archive/bridge-moe-validation-printed-layouts/README.md": bridge_moe_first,
    "benchmarks/results/archive/bridge-moe-validation-forward-host-gap/README.md": bridge_moe_second,
    "docs/planning.md": lambda: {k: v for k, v in bridge_moe_folder().items()
                                 if k in ("bridge.median", "bridge.max", "bridge.unfit", "bridge.within", "first.median",
                                          "first.max", "second.median", "second.max")}
    | planning_record() | planning_towers(),
    "benchmarks/results/plan-sweep/README.md": plan_sweep,
    "benchmarks/results/plan-sweep/2026-12-03/README.md": plan_sweep_earlier("2026-12-03", partial=True),
    "benchmarks/results/plan-sweep/2026-12-02/README.md": plan_sweep_earlier("2026-12-02"),
    "docs/input-validation.md": secret_detector,
}
