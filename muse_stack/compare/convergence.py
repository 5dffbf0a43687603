"""Loss-curve convergence of a candidate run against a golden (reference) run.

The statistical checks and their default thresholds follow Megatron-Bridge's convergence
check: Pearson correlation >= 0.95; point-wise relative tolerance by golden loss magnitude
(10% above 2.0, 5% above 0.5, 2% otherwise), failing when more than 10% of points fail;
final loss within 3%; at most 10% 3-sigma outliers of the residual; optionally skip a fraction
of the first points (Bridge's ``skip_first_percent``, a fraction: 0.2 skips the first 20%).
Those are the defaults of Bridge's function (:data:`PRESETS` ``bridge-function``); Bridge's
performance pipeline runs it with a 5% final-loss tolerance and the first 20% skipped
(``bridge-pipeline``). A flat golden curve has no correlation to measure: it is judged on the
point-wise and final-loss checks.

Unlike Bridge, the curves must cover the same steps: a step missing from either run, a
duplicated step, runs of different lengths, or a NaN/Inf loss or grad norm in either run
fail the check and say which steps. (Bridge turns missing steps into NaN, which then pass
every comparison, so a run that died at step 30 of 50 passes there.)

:func:`check_validation` judges the validation curves the same way (``compare --validation``):
the ``val_loss`` of each step that records one (recipe ``validation``), with the same statistical
checks and thresholds; both runs must have validated at the same steps, with finite losses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from muse_stack.compare.runs import Metrics


@dataclass
class Thresholds:
    correlation_min: float = 0.95
    high_loss_above: float = 2.0
    medium_loss_above: float = 0.5
    high_loss_tolerance: float = 0.10
    medium_loss_tolerance: float = 0.05
    low_loss_tolerance: float = 0.02
    max_pointwise_failure_ratio: float = 0.10
    final_loss_tolerance: float = 0.03
    outlier_sigma: float = 3.0
    max_outlier_ratio: float = 0.10
    skip_first: float = 0.0  # a fraction of the points, as Bridge's skip_first_percent: 0.2 skips 20%

    def __post_init__(self) -> None:
        if not 0.0 <= self.skip_first < 1.0:
            raise ValueError(f"skip_first is a fraction in [0, 1), got {self.skip_first!r}")

    def tolerance_for(self, golden: float) -> float:
        if golden > self.high_loss_above:
            return self.high_loss_tolerance
        if golden > self.medium_loss_above:
            return self.medium_loss_tolerance
        return self.low_loss_tolerance


#: named threshold sets: Bridge's validate_convergence function defaults, and the thresholds its
#: performance pipeline passes (the B200 record's convergence check used these)
PRESETS: dict[str, dict[str, float]] = {
    "bridge-function": {"final_loss_tolerance": 0.03, "skip_first": 0.0},
    "bridge-pipeline": {"final_loss_tolerance": 0.05, "skip_first": 0.2},
}


def parse_skip(text: str) -> float:
    """A skip given as Bridge gives it, a fraction in [0, 1) ("0.2"), or as a percent with its sign
    ("20%"); a bare number of 1 or more is ambiguous (20 could be meant as 20% or as a fraction
    out of range) and is refused, as is anything else that is not a number in range."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError:
        raise ValueError(f"{text!r} is not a number: write a fraction such as 0.2, or a percent such as 20%") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is out of range: write a fraction in [0, 1) such as 0.2, or 0-99%")
    if percent:
        if value >= 100:
            raise ValueError(f"{text!r} skips every point: write at most 99%")
        return value / 100.0
    if value >= 1:
        raise ValueError(f"{text!r} is ambiguous: the skip is a fraction, as in Megatron-Bridge (0.2 skips the "
                         f"first 20%); write 0.2 or 20%")
    return value


@dataclass
class Check:
    name: str
    passed: bool
    value: Any
    threshold: Any
    detail: str
    rule: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ConvergenceResult:
    checks: list[Check] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps compared (after skipping)
    golden: list[float] = field(default_factory=list)
    candidate: list[float] = field(default_factory=list)
    skipped: int = 0
    thresholds: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "failed_checks": self.failed,
            "points_compared": len(self.steps),
            "points_skipped": self.skipped,
            "thresholds": self.thresholds,
            "checks": [c.as_dict() for c in self.checks],
        }


def step_ranges(steps: list[int] | set[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"."""
    ordered = sorted(steps)
    if not ordered:
        return ""
    parts = []
    start = prev = ordered[0]
    for s in ordered[1:]:
        if s == prev + 1:
            prev = s
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = s
    parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)


def _integrity(golden: Metrics, candidate: Metrics) -> list[Check]:
    g_steps = {r.step for r in golden.steps}
    c_steps = {r.step for r in candidate.steps}
    last = max(g_steps | c_steps, default=0)
    expected = set(range(1, last + 1))
    checks = []

    same_length = len(g_steps) == len(c_steps) and max(g_steps, default=0) == max(c_steps, default=0)
    checks.append(
        Check(
            "equal lengths",
            same_length and bool(g_steps),
            {"golden": len(g_steps), "candidate": len(c_steps)},
            "equal, non-empty",
            f"golden has {len(g_steps)} steps (last {max(g_steps, default=0)}), "
            f"candidate {len(c_steps)} (last {max(c_steps, default=0)})",
            "same number of steps",
        )
    )

    problems = []
    g_missing, c_missing = expected - g_steps, expected - c_steps
    if g_missing:
        problems.append(f"golden is missing steps {step_ranges(g_missing)}")
    if c_missing:
        problems.append(f"candidate is missing steps {step_ranges(c_missing)}")
    checks.append(
        Check(
            "no missing steps",
            not problems,
            {"golden": sorted(g_missing), "candidate": sorted(c_missing)},
            f"every step 1-{last} in both",
            "; ".join(problems) or f"steps 1-{last} present in both runs",
            "every step in both runs",
        )
    )

    if golden.duplicates or candidate.duplicates:
        detail = "; ".join(
            f"{name} repeats steps {step_ranges(set(m.duplicates))}"
            for name, m in (("golden", golden), ("candidate", candidate))
            if m.duplicates
        )
        checks.append(Check("no duplicate steps", False,
                            {"golden": golden.duplicates, "candidate": candidate.duplicates}, "none", detail,
                            "each step once"))

    bad: dict[str, dict[str, list[int]]] = {}
    for name, m in (("golden", golden), ("candidate", candidate)):
        loss_bad = [r.step for r in m.steps if not math.isfinite(r.loss)]
        grad_bad = [r.step for r in m.steps if not math.isfinite(r.grad_norm)]
        if loss_bad or grad_bad:
            bad[name] = {"loss": loss_bad, "grad_norm": grad_bad}
    detail = "; ".join(
        f"{name} {what} not finite (NaN/Inf/null) at steps {step_ranges(set(steps))}"
        for name, per in bad.items()
        for what, steps in per.items()
        if steps
    )
    checks.append(Check("finite loss and grad norm", not bad, bad, "all finite", detail or "all finite",
                        "no NaN/Inf"))
    return checks


def validation_points(metrics: Metrics) -> dict[int, float]:
    """step -> the validation loss recorded at that step (``val_loss`` in its metrics row); a
    null or non-number is NaN (it fails the finite check)."""
    from muse_stack.compare.runs import _number

    out: dict[int, float] = {}
    for r in metrics.steps:
        if "val_loss" in r.raw:
            try:
                out[r.step] = _number(r.raw["val_loss"])
            except (TypeError, ValueError):
                out[r.step] = math.nan
    return out


def check_validation(golden: Metrics, candidate: Metrics, thresholds: Thresholds | None = None) -> ConvergenceResult:
    """The validation curves of two runs, judged as :func:`check_convergence` judges the
    training curves, over the steps both validated at."""
    t = thresholds or Thresholds()
    result = ConvergenceResult(thresholds=asdict(t))
    g, c = validation_points(golden), validation_points(candidate)
    none = [name for name, points in (("golden", g), ("candidate", c)) if not points]
    result.checks.append(Check(
        "validation recorded", not none, {"golden": len(g), "candidate": len(c)}, "both runs",
        "; ".join(f"{name} records no val_loss (its recipe has no validation section)" for name in none)
        or f"golden {len(g)} points, candidate {len(c)}", "val_loss in both runs"))
    if none:
        return result
    g_only, c_only = set(g) - set(c), set(c) - set(g)
    detail = "; ".join(f"only the {name} validated at steps {step_ranges(only)}"
                       for name, only in (("golden", g_only), ("candidate", c_only)) if only)
    result.checks.append(Check("same validation steps", not detail,
                               {"golden_only": sorted(g_only), "candidate_only": sorted(c_only)}, "equal",
                               detail or f"steps {step_ranges(set(g))} in both", "validated at the same steps"))
    bad = {name: sorted(s for s, v in points.items() if not math.isfinite(v))
           for name, points in (("golden", g), ("candidate", c))}
    bad = {k: v for k, v in bad.items() if v}
    result.checks.append(Check(
        "finite validation loss", not bad, bad, "all finite",
        "; ".join(f"{name} val_loss not finite at steps {step_ranges(set(steps))}" for name, steps in bad.items())
        or "all finite", "no NaN/Inf"))
    return _statistics(result, g, c, t)


def check_convergence(golden: Metrics, candidate: Metrics, thresholds: Thresholds | None = None) -> ConvergenceResult:
    t = thresholds or Thresholds()
    result = ConvergenceResult(thresholds=asdict(t))
    result.checks.extend(_integrity(golden, candidate))

    g_by_step = {r.step: r.loss for r in golden.steps}
    c_by_step = {r.step: r.loss for r in candidate.steps}
    return _statistics(result, g_by_step, c_by_step, t)


def _statistics(result: ConvergenceResult, g_by_step: dict[int, float], c_by_step: dict[int, float],
                t: Thresholds) -> ConvergenceResult:
    """Correlation, point-wise tolerance, final loss and outliers of two curves (step -> loss)."""
    common = sorted(s for s in g_by_step.keys() & c_by_step.keys()
                    if math.isfinite(g_by_step[s]) and math.isfinite(c_by_step[s]))
    skip = max(0, int(len(common) * t.skip_first))
    steps = common[skip:]
    result.skipped = skip
    result.steps = steps
    g = np.array([g_by_step[s] for s in steps], dtype=float)
    c = np.array([c_by_step[s] for s in steps], dtype=float)
    result.golden, result.candidate = g.tolist(), c.tolist()

    if len(steps) < 2:
        result.checks.append(Check("enough points", False, len(steps), ">= 2",
                                   f"{len(steps)} comparable points after skipping {skip}", ">= 2 points"))
        return result

    # correlation: undefined for a flat golden curve, which is then judged on the point-wise and
    # final-loss checks alone (a candidate that wanders off a flat curve fails those)
    if np.ptp(g) == 0:
        result.checks.append(
            Check("correlation", True, None, t.correlation_min,
                  "not applicable: the golden curve is flat, so it is judged on the point-wise and final-loss checks",
                  f"r >= {t.correlation_min:g} (golden not flat)"))
    else:
        corr = float(np.corrcoef(g, c)[0, 1]) if np.ptp(c) != 0 else float("nan")
        result.checks.append(
            Check("correlation", bool(corr >= t.correlation_min), corr, t.correlation_min,
                  f"Pearson r = {corr:.5f}" + (" (the candidate curve is constant)" if math.isnan(corr) else ""),
                  f"r >= {t.correlation_min:g}")
        )

    # point-wise tolerance by golden magnitude
    tol = np.array([t.tolerance_for(v) for v in g])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(g != 0, np.abs(c - g) / np.abs(g), np.abs(c))
    fails = [int(s) for s, ok in zip(steps, rel <= tol) if not ok]
    ratio = len(fails) / len(steps)
    worst = int(np.argmax(rel - tol))
    result.checks.append(
        Check(
            "point-wise tolerance",
            ratio <= t.max_pointwise_failure_ratio,
            {"failures": len(fails), "points": len(steps), "ratio": ratio},
            t.max_pointwise_failure_ratio,
            f"{len(fails)}/{len(steps)} points outside tolerance"
            + (f" at steps {step_ranges(fails)}" if fails else "")
            + f"; largest excess at step {steps[worst]}: {rel[worst]:.2%} vs {tol[worst]:.0%}",
            f"<= {t.max_pointwise_failure_ratio:.0%} of points fail",
        )
    )

    # final loss
    g_last, c_last = float(g[-1]), float(c[-1])
    final = abs(c_last - g_last) / abs(g_last) if g_last != 0 else abs(c_last)
    result.checks.append(
        Check("final loss", final <= t.final_loss_tolerance, final, t.final_loss_tolerance,
              f"step {steps[-1]}: golden {g_last:.5f}, candidate {c_last:.5f} ({final:.3%})",
              f"<= {t.final_loss_tolerance:.1%}")
    )

    # 3-sigma outliers of the residual
    resid = c - g
    std = float(np.std(resid))
    outliers = np.abs(resid - np.mean(resid)) > t.outlier_sigma * std
    o_steps = [int(s) for s, o in zip(steps, outliers) if o]
    o_ratio = len(o_steps) / len(steps)
    result.checks.append(
        Check(f"{t.outlier_sigma:g}-sigma outliers", o_ratio <= t.max_outlier_ratio,
              {"outliers": len(o_steps), "ratio": o_ratio}, t.max_outlier_ratio,
              f"{len(o_steps)}/{len(steps)} residual outliers" + (f" at steps {step_ranges(o_steps)}" if o_steps else ""),
              f"<= {t.max_outlier_ratio:.0%} of points")
    )
    return result
