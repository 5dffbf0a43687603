"""Compare a candidate run with a golden run: convergence, throughput, memory, stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse_stack.compare.convergence import ConvergenceResult, Thresholds, check_convergence, check_validation
from muse_stack.compare.diff import diff_inputs
from muse_stack.compare.plot import plot_losses
from muse_stack.compare.runs import read_metrics, read_results, require_run_dir
from muse_stack.fingerprint.absent import absent, is_absent
from muse_stack.fingerprint.document import resolve

PERF_FIELDS = (
    ("tokens_per_s_per_gpu", "tokens/s per GPU"),
    ("peak_memory_gib", "peak memory GiB"),
    ("step_time_cv_percent", "step-time CV %"),
    ("model_tflops_per_gpu", "model TFLOP/s per GPU"),
    ("mfu", "MFU"),
)


@dataclass
class Gates:
    """Optional performance gates (off unless set): allowed throughput drop and memory rise, in percent."""

    max_throughput_drop_percent: float | None = None
    max_memory_increase_percent: float | None = None


@dataclass
class CompareReport:
    reference: str
    candidate: str
    convergence: ConvergenceResult
    performance: dict[str, Any]
    gates: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None
    bitwise: dict[str, Any] = field(default_factory=dict)
    #: the validation curves' checks (``compare --validation``), None when not asked for
    validation: ConvergenceResult | None = None

    @property
    def passed(self) -> bool:
        return (self.convergence.passed and (self.validation is None or self.validation.passed)
                and all(g["passed"] for g in self.gates))

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def as_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "candidate": self.candidate,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "bitwise": self.bitwise,
            "convergence": self.convergence.as_dict(),
            "performance": self.performance,
            "gates": self.gates,
            "fingerprint_diff": self.fingerprint,
            "plot": self.plot,
        }
        if self.validation is not None:
            out["validation"] = self.validation.as_dict()
        return out


def bitwise(golden, candidate) -> dict[str, Any]:
    """Whether the two runs' loss and grad norm are the same floats at every step (as written in
    metrics.jsonl, which keeps each float's shortest round-trip repr: equal text, equal bits)."""
    g = {r.step: (r.loss, r.grad_norm) for r in golden.steps}
    c = {r.step: (r.loss, r.grad_norm) for r in candidate.steps}
    out: dict[str, Any] = {"identical": False, "steps": len(g)}
    if not g or set(g) != set(c):
        out["detail"] = "the runs do not have the same steps" if g else "no steps"
        return out
    for step in sorted(g):
        for i, name in enumerate(("loss", "grad_norm")):
            a, b = g[step][i], c[step][i]
            if not (a == b or (a != a and b != b)):  # NaN equals NaN here: both wrote the same non-number
                out["first_difference"] = {"step": step, "field": name, "golden": a, "candidate": b}
                out["detail"] = f"differ first at step {step} ({name}: {a!r} vs {b!r})"
                return out
    out["identical"] = True
    out["detail"] = f"loss and grad norm equal bit for bit at all {len(g)} steps"
    return out


def _metric(results: dict[str, Any] | None, run: Path, key: str) -> Any:
    if results is None:
        return absent(f"{run / 'results.json'} missing")
    value = results.get(key)
    if value is None:
        return absent(f"{key} not recorded in {run / 'results.json'}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return absent(f"{key} in {run / 'results.json'} is not a number: {value!r}")
    return float(value)


def performance(ref_run: Path, cand_run: Path) -> dict[str, Any]:
    ref, cand = read_results(ref_run), read_results(cand_run)
    out: dict[str, Any] = {
        "reference_status": (ref or {}).get("status", absent("no results.json")),
        "candidate_status": (cand or {}).get("status", absent("no results.json")),
        "reference_window": (ref or {}).get("window", absent("no results.json")),
        "candidate_window": (cand or {}).get("window", absent("no results.json")),
    }
    for key, _label in PERF_FIELDS:
        a, b = _metric(ref, ref_run, key), _metric(cand, cand_run, key)
        entry: dict[str, Any] = {"reference": a, "candidate": b}
        if not is_absent(a) and not is_absent(b):
            entry["delta"] = b - a
            entry["delta_percent"] = (b - a) / a * 100 if a else None
        out[key] = entry
    return out


def _gates(perf: dict[str, Any], gates: Gates) -> list[dict[str, Any]]:
    out = []
    for key, limit, direction in (
        ("tokens_per_s_per_gpu", gates.max_throughput_drop_percent, -1),
        ("peak_memory_gib", gates.max_memory_increase_percent, 1),
    ):
        if limit is None:
            continue
        entry = perf[key]
        pct = entry.get("delta_percent")
        if pct is None:
            out.append({"gate": key, "passed": False, "limit_percent": limit,
                        "detail": f"{key} not available in both runs"})
            continue
        moved = pct * direction  # positive = worse
        out.append({
            "gate": key,
            "passed": moved <= limit,
            "limit_percent": limit,
            "detail": f"{key} {pct:+.2f}% ({'drop' if direction < 0 else 'rise'} allowed up to {limit}%)",
        })
    return out


def fingerprint_summary(ref_run: Path, cand_run: Path) -> dict[str, Any]:
    missing = [str(resolve(r)) for r in (ref_run, cand_run) if not resolve(r).exists()]
    if missing:
        return absent(f"no fingerprint to compare: {', '.join(missing)} missing")
    report = diff_inputs(ref_run, cand_run, complete=False)
    by_cls: dict[str, list[str]] = {"numerics": [], "performance": [], "informational": []}
    for d in report.differences:
        by_cls[d.cls].append(d.path)
    return {
        "verdict": report.verdict,
        "exit_code": report.exit_code,
        "counts": report.counts,
        "numerics": by_cls["numerics"][:20],
        "performance": by_cls["performance"][:20],
        "informational": by_cls["informational"][:20],
    }


def compare_runs(
    reference: str | Path,
    candidate: str | Path,
    thresholds: Thresholds | None = None,
    gates: Gates | None = None,
    plot: str | Path | None = None,
    make_plot: bool = True,
    validation: bool = False,
) -> CompareReport:
    """``validation``: also judge the runs' validation curves (``val_loss``), with the same thresholds."""
    ref_run, cand_run = require_run_dir(reference), require_run_dir(candidate)
    golden, cand = read_metrics(ref_run), read_metrics(cand_run)
    conv = check_convergence(golden, cand, thresholds)
    perf = performance(ref_run, cand_run)
    report = CompareReport(
        reference=str(ref_run),
        candidate=str(cand_run),
        convergence=conv,
        performance=perf,
        gates=_gates(perf, gates or Gates()),
        fingerprint=fingerprint_summary(ref_run, cand_run),
        bitwise=bitwise(golden, cand),
        validation=check_validation(golden, cand, thresholds) if validation else None,
    )
    if make_plot:
        ref_name = ref_run.resolve().name
        out = Path(plot) if plot else cand_run / f"compare-{ref_name}.png"
        failed = conv.failed + [f"validation {name}" for name in (report.validation.failed
                                                                   if report.validation else [])]
        failed += [g["gate"] for g in report.gates if not g["passed"]]
        verdict = "PASS" if report.passed else "FAIL: " + ", ".join(failed)
        plot_losses(golden, cand, ref_name, cand_run.resolve().name, out, title=f"{cand_run.resolve().name} vs {ref_name} — {verdict}")
        report.plot = str(out)
    return report
