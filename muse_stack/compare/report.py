"""Rich rendering of fingerprint diffs, audits and run comparisons."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from muse_stack.compare.audit import MATCH, MISMATCH, AuditReport
from muse_stack.compare.diff import DiffReport
from muse_stack.compare.runcompare import PERF_FIELDS, CompareReport
from muse_stack.fingerprint.absent import is_absent
from muse_stack.fingerprint.tree import summarize

CLASS_STYLE = {"numerics": "bold red", "performance": "yellow", "informational": "dim"}
STATUS_STYLE = {MATCH: "green", MISMATCH: "bold red", "not verifiable": "yellow"}


def _fmt(value: Any, digits: int = 4) -> str:
    if is_absent(value):
        return f"absent: {value['absent']}"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-3 or abs(value) >= 1e5 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return str(value)


def render_diff(report: DiffReport, console: Console) -> None:
    console.print(f"[bold]fingerprint diff[/]  A = {report.a_name}   B = {report.b_name}")
    for section, diffs in report.by_section().items():
        table = Table(title=section, title_justify="left", show_lines=False, expand=False)
        table.add_column("field", overflow="fold")
        table.add_column("A", overflow="fold", max_width=48)
        table.add_column("B", overflow="fold", max_width=48)
        table.add_column("class")
        prefix = len(section) + 1
        for d in diffs:
            table.add_row(d.path[prefix:] or section, summarize(d.a), summarize(d.b),
                          Text(d.cls, style=CLASS_STYLE[d.cls]))
        console.print(table)
    counts = report.counts
    console.print(
        f"[bold]{report.verdict}[/]: {counts['numerics']} numerics, {counts['performance']} performance, "
        f"{counts['informational']} informational (capture time and pid ignored) → exit {report.exit_code}"
    )


def render_audit(report: AuditReport, console: Console) -> None:
    table = Table(title=f"audit of {report.fingerprint} against {report.source}", show_lines=False)
    table.add_column("component", no_wrap=True)
    table.add_column("expects", overflow="fold", max_width=22)
    table.add_column("found", overflow="fold", max_width=22)
    table.add_column("status", no_wrap=True)
    table.add_column("note", overflow="fold", ratio=1)
    for c in report.checks:
        table.add_row(c.component, c.expected or "—", c.found or "—",
                      Text(c.status, style=STATUS_STYLE[c.status]), c.note)
    console.print(table)
    n = report.counts
    console.print(f"{n['match']} match, {n['mismatch']} mismatch, {n['not verifiable']} not verifiable → exit {report.exit_code}")


def render_compare(report: CompareReport, console: Console) -> None:
    console.print(f"[bold]compare[/]  golden = {report.reference}   candidate = {report.candidate}")
    conv = report.convergence
    table = Table(title=f"convergence ({len(conv.steps)} points compared, {conv.skipped} skipped)", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("rule")
    table.add_column("detail", overflow="fold", ratio=1)
    for c in conv.checks:
        verdict = "n/a" if c.passed and c.value is None else "pass" if c.passed else "FAIL"
        table.add_row(c.name, Text(verdict, style="green" if c.passed else "bold red"),
                      c.rule, c.detail)
    console.print(table)
    val = report.validation
    if val is not None:  # compare --validation: the held-out loss curves, the same checks
        vtable = Table(title=f"validation ({len(val.steps)} points compared, {val.skipped} skipped)",
                       title_justify="left")
        for column in ("check", "result", "rule"):
            vtable.add_column(column)
        vtable.add_column("detail", overflow="fold", ratio=1)
        for c in val.checks:
            verdict = "n/a" if c.passed and c.value is None else "pass" if c.passed else "FAIL"
            vtable.add_row(c.name, Text(verdict, style="green" if c.passed else "bold red"), c.rule, c.detail)
        console.print(vtable)
    if report.bitwise.get("identical"):
        console.print(Text(f"bitwise identical: {report.bitwise['detail']}", style="bold green"))
    elif report.bitwise:
        console.print(f"not bitwise identical: {report.bitwise.get('detail', '')}")

    perf = Table(title="performance (results.json, measurement window)", title_justify="left")
    perf.add_column("metric")
    perf.add_column("golden", overflow="fold", max_width=36)
    perf.add_column("candidate", overflow="fold", max_width=36)
    perf.add_column("delta")
    for key, label in PERF_FIELDS:
        e = report.performance[key]
        delta = ""
        if "delta" in e:
            pct = e.get("delta_percent")
            delta = f"{e['delta']:+.4g}" + (f" ({pct:+.2f}%)" if pct is not None else "")
        perf.add_row(label, _fmt(e["reference"]), _fmt(e["candidate"]), delta)
    perf.add_row("status", _fmt(report.performance["reference_status"]), _fmt(report.performance["candidate_status"]), "")
    perf.add_row("window", _fmt(report.performance["reference_window"]), _fmt(report.performance["candidate_window"]), "")
    console.print(perf)
    for g in report.gates:
        style = "green" if g["passed"] else "bold red"
        console.print(Text(f"gate {g['gate']}: {'pass' if g['passed'] else 'FAIL'} — {g['detail']}", style=style))

    fp = report.fingerprint
    if is_absent(fp):
        console.print(f"stack: [yellow]{fp['absent']}[/]")
    else:
        c = fp["counts"]
        console.print(f"stack: {fp['verdict']} ({c['numerics']} numerics, {c['performance']} performance, "
                      f"{c['informational']} informational)")
        for cls in ("numerics", "performance"):
            if fp[cls]:
                console.print(Text(f"  {cls}: " + ", ".join(fp[cls][:8]) + (" …" if len(fp[cls]) > 8 else ""),
                                   style=CLASS_STYLE[cls]))
    if report.plot:
        console.print(f"plot: {report.plot}")
    verdict = "PASS" if report.passed else "FAIL"
    console.print(Text(f"{verdict} → exit {report.exit_code}", style="bold green" if report.passed else "bold red"))
