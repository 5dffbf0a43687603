"""Differences between two stack fingerprints, each classified (see classify.py). Between two
run directories the resolved recipes are compared too (section ``recipe``), so a diff names
the recipe fields that differ, not only the recipe's hash."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse_stack.compare.classify import CLASSES, INFORMATIONAL, NUMERICS, PERFORMANCE, VOLATILE, classify
from muse_stack.fingerprint.tree import MISSING, Change, changes, dotted, summarize


@dataclass(frozen=True)
class Difference:
    path: str
    section: str
    kind: str
    cls: str
    a: Any
    b: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "section": self.section,
            "class": self.cls,
            "kind": self.kind,
            "a": None if self.a is MISSING else self.a,
            "b": None if self.b is MISSING else self.b,
            "a_text": summarize(self.a),
            "b_text": summarize(self.b),
        }


@dataclass
class DiffReport:
    a_name: str
    b_name: str
    differences: list[Difference] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(CLASSES, 0)
        for d in self.differences:
            out[d.cls] += 1
        return out

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def exit_code(self) -> int:
        """0 identical or only informational fields differ (host names, paths, times: two runs on one
        stack), 1 performance-affecting differences, 2 numerics differ."""
        if any(d.cls == NUMERICS for d in self.differences):
            return 2
        return 1 if any(d.cls == PERFORMANCE for d in self.differences) else 0

    @property
    def verdict(self) -> str:
        if self.identical:
            return "identical"
        if self.exit_code == 2:
            return "numerics differ"
        if any(d.cls == PERFORMANCE for d in self.differences):
            return "performance-affecting differences only"
        return "informational differences only"

    def by_section(self) -> dict[str, list[Difference]]:
        out: dict[str, list[Difference]] = {}
        for d in self.differences:
            out.setdefault(d.section, []).append(d)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a_name,
            "b": self.b_name,
            "identical": self.identical,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "counts": self.counts,
            "ignored": list(VOLATILE),
            "differences": [d.as_dict() for d in self.differences],
        }


def _difference(change: Change) -> Difference:
    """One difference, its values as shown: a credential a document holds is never printed
    (:func:`muse_stack.util.credentials.redact_value`)."""
    from muse_stack.util.credentials import redact_text, redact_value

    path = dotted(change.path)
    return Difference(
        path=redact_text(path),
        section=change.path[0] if change.path else "(document)",
        kind=change.kind,
        cls=classify(path),
        a=redact_value(change.a),
        b=redact_value(change.b),
    )


def diff_documents(a: dict[str, Any], b: dict[str, Any], a_name: str = "A", b_name: str = "B") -> DiffReport:
    """Every difference between two fingerprints, except capture time, duration and pid."""
    found = changes(a, b, skip=VOLATILE)
    return DiffReport(a_name, b_name, [_difference(c) for c in found])


def _run_recipe(path: str | Path) -> dict[str, Any] | None:
    from muse_stack.compare.runs import read_recipe

    run = Path(path)
    return read_recipe(run) if run.is_dir() and (run / "recipe.yaml").is_file() else None


def diff_inputs(a: str | Path, b: str | Path, *, complete: bool = True) -> DiffReport:
    """Diff two fingerprint files or run directories; when both are run directories with a
    recipe.yaml, their resolved recipes are compared as well. With ``complete`` a document missing
    a section a capture writes is refused as corrupt (exit 3) rather than reported as differences."""
    from muse_stack.fingerprint.document import load_fingerprint

    doc_a, doc_b = load_fingerprint(a, complete=complete), load_fingerprint(b, complete=complete)
    recipe_a, recipe_b = _run_recipe(a), _run_recipe(b)
    if recipe_a is None or recipe_b is None:
        return diff_documents(doc_a, doc_b, str(a), str(b))
    report = diff_documents({**doc_a, "recipe": recipe_a}, {**doc_b, "recipe": recipe_b}, str(a), str(b))
    return _recipe_hash_as_its_fields(report)


#: the fingerprint's hash of the whole resolved recipe (and of each recorded change's two recipes)
RECIPE_HASHES = ("run_inputs.recipe_sha256", "run_inputs.changes.*.recipe_sha256_before",
                 "run_inputs.changes.*.recipe_sha256_after")


def _recipe_hash_as_its_fields(report: DiffReport) -> DiffReport:
    """With both resolved recipes compared field by field, a differing recipe hash says nothing more: it
    takes the class of the most severe recipe field that differs (informational when only a field's record
    differs, e.g. a value stated in one run and filled in the other, or a bookkeeping field such as
    ``training.keep_checkpoints`` that is not numerics), rather than numerics for any change at all."""
    from fnmatch import fnmatchcase

    classes = {d.cls for d in report.differences if d.section == "recipe"}
    worst = next((c for c in (NUMERICS, PERFORMANCE) if c in classes), INFORMATIONAL)
    report.differences = [dataclasses.replace(d, cls=worst)
                          if any(fnmatchcase(d.path, p) for p in RECIPE_HASHES) else d for d in report.differences]
    return report
