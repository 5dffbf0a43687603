"""Audit a run's fingerprint against the stack its recipe recorded.

Recorded stacks are free text as their source states them ("2.17.0 (PyTorch extension
rebuilt ...)", "EFA 1.49 (aws-ofi-nccl 1.20)"). Each is parsed into one or more expected
components, and each component is looked up in the fingerprint: ``match``, ``mismatch``, or
``not verifiable`` (with the reason: the fingerprint lacks the field, the field was absent on
that machine, or the record states no version).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from muse_stack.compare.versions import first_version, precision_note, versions_match
from muse_stack.fingerprint.absent import is_absent
from muse_stack.fingerprint.pyenv import normalize

MATCH = "match"
MISMATCH = "mismatch"
NOT_VERIFIABLE = "not verifiable"
STATUSES = (MATCH, MISMATCH, NOT_VERIFIABLE)


@dataclass(frozen=True)
class Expectation:
    component: str
    key: str  # the recorded stack key it came from
    recorded: str  # the recorded free text
    expected: str | None  # the version (or commit, count) it states; None if none
    path: tuple[str, ...] | None  # where the fingerprint holds it; None if nowhere
    compare: str = "version"  # version | commit | count
    why_unverifiable: str | None = None
    distribution: str | None = None  # a distribution name the record names


@dataclass(frozen=True)
class Check:
    component: str
    key: str
    recorded: str
    expected: str | None
    found: str | None
    status: str
    note: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class AuditReport:
    source: str
    fingerprint: str
    checks: list[Check] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for c in self.checks:
            out[c.status] += 1
        return out

    @property
    def exit_code(self) -> int:
        """0 every component matches, 1 some cannot be verified, 2 any mismatch."""
        statuses = {c.status for c in self.checks}
        if MISMATCH in statuses:
            return 2
        if NOT_VERIFIABLE in statuses:
            return 1
        return 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "recorded_stack": self.source,
            "fingerprint": self.fingerprint,
            "exit_code": self.exit_code,
            "counts": self.counts,
            "checks": [c.as_dict() for c in self.checks],
        }


def _simple(component: str, path: tuple[str, ...]) -> Callable[[str, str], list[Expectation]]:
    def parse(key: str, text: str) -> list[Expectation]:
        return [Expectation(component, key, text, first_version(text), path)]

    return parse


def _pytorch(key: str, text: str) -> list[Expectation]:
    out = [Expectation("pytorch", key, text, first_version(text), ("frameworks", "torch", "version"))]
    m = re.search(r"CUDA\s+(\d+(?:\.\d+)+)\s+build", text, re.I)
    if m:
        out.append(Expectation("pytorch CUDA build", key, text, m.group(1), ("frameworks", "torch", "cuda_build")))
    return out


def _deepep(key: str, text: str) -> list[Expectation]:
    m = re.match(r"\s*([A-Za-z][\w.\-]*)\s+v?\d", text)
    dist = m.group(1) if m else None
    return [Expectation("deepep", key, text, first_version(text), ("frameworks", "deepep", "version"), distribution=dist)]


def _commit_of(name: str, text: str) -> str | None:
    m = re.search(rf"{re.escape(name)}\S*\s+commit\s+([0-9a-f]{{7,40}})", text, re.I) or re.search(
        r"commit\s+([0-9a-f]{7,40})", text, re.I
    )
    return m.group(1) if m else None


def _megatron(key: str, text: str) -> list[Expectation]:
    out = []
    m = re.search(r"megatron[-_]core\s+v?(\d+(?:\.\d+)+\S*?)(?=[\s);,]|$)", text, re.I)
    if m:
        out.append(Expectation("megatron-core", key, text, m.group(1), ("frameworks", "megatron_core", "version")))
    commit = _commit_of("Megatron-LM", text)
    if commit:
        clean = bool(re.search(r"no local changes|clean", text, re.I))
        out.append(
            Expectation(
                "Megatron-LM commit",
                key,
                text,
                commit + (" (no local changes)" if clean else ""),
                ("frameworks", "megatron_core", "git"),
                compare="commit",
            )
        )
    if not out:
        out.append(Expectation("megatron-lm", key, text, first_version(text), ("frameworks", "megatron_core", "version")))
    return out


def _framework(key: str, text: str) -> list[Expectation]:
    m = re.match(r"\s*([\w./\-]+)\s+commit\s+([0-9a-f]{7,40})", text, re.I)
    if m:
        name = m.group(1)
        return [
            Expectation(
                f"{name} commit",
                key,
                text,
                m.group(2),
                None,
                compare="commit",
                why_unverifiable=f"the fingerprint does not record a {name} checkout",
            )
        ]
    return [
        Expectation(
            "framework", key, text, first_version(text), None,
            why_unverifiable="the fingerprint does not record the training framework",
        )
    ]


def _network(key: str, text: str) -> list[Expectation]:
    out = []
    m = re.search(r"(\d+)\s+GPUs?\s+per\s+node", text, re.I)
    if m:
        out.append(Expectation("GPUs per node", key, text, m.group(1), ("gpu", "count"), compare="count"))
    m = re.search(r"\bEFA\s+(?:installer\s+)?v?(\d+(?:\.\d+)+)", text, re.I)
    if m:
        out.append(Expectation("efa", key, text, m.group(1), ("network", "efa", "installer_version")))
    m = re.search(r"aws-ofi-nccl\s+v?(\d+(?:\.\d+)+)", text, re.I)
    if m:
        out.append(Expectation("aws-ofi-nccl", key, text, m.group(1), ("network", "aws_ofi_nccl", "version")))
    m = re.search(r"libfabric\s+v?(\d+(?:\.\d+)+)", text, re.I)
    if m:
        out.append(Expectation("libfabric", key, text, m.group(1), ("network", "libfabric", "version")))
    return out


PARSERS: dict[str, Callable[[str, str], list[Expectation]]] = {
    "framework": _framework,
    "megatron_lm": _megatron,
    "transformer_engine": _simple("transformer_engine", ("frameworks", "transformer_engine", "version")),
    "pytorch": _pytorch,
    "cuda": _simple("cuda", ("cuda_libraries", "cuda_runtime", "version")),
    "nccl": _simple("nccl", ("cuda_libraries", "nccl", "version")),
    "cudnn": _simple("cudnn", ("cuda_libraries", "cudnn", "version")),
    "flash_attn": _simple("flash_attn", ("frameworks", "flash_attn", "version")),
    "deepep": _deepep,
    "python": _simple("python", ("python", "version")),
    "network": _network,
}
NOT_AUDITED = ("source",)


def expectations(stack: dict[str, Any]) -> list[Expectation]:
    out: list[Expectation] = []
    for key, value in stack.items():
        if value is None or key in NOT_AUDITED:
            continue
        text = str(value)
        parser = PARSERS.get(key)
        if parser is None:
            out.append(Expectation(key, key, text, first_version(text), None,
                                   why_unverifiable=f"no fingerprint field corresponds to the recorded {key!r}"))
            continue
        out.extend(parser(key, text))
    return out


def lookup(doc: dict[str, Any], path: tuple[str, ...]) -> tuple[Any, str | None]:
    """(value, None) or (None, why it cannot be read)."""
    node: Any = doc
    walked: list[str] = []
    for part in path:
        if is_absent(node):
            return None, f"{'.'.join(walked)} absent in the fingerprint: {node['absent']}"
        if not isinstance(node, dict) or part not in node:
            return None, f"the fingerprint has no {'.'.join([*walked, part])}"
        node = node[part]
        walked.append(part)
    if is_absent(node):
        return None, f"{'.'.join(walked)} absent in the fingerprint: {node['absent']}"
    return node, None


def _check(exp: Expectation, doc: dict[str, Any]) -> Check:
    def done(status: str, found: str | None, note: str) -> Check:
        return Check(exp.component, exp.key, exp.recorded, exp.expected, found, status, note)

    if exp.path is None:
        return done(NOT_VERIFIABLE, None, exp.why_unverifiable or "not recorded in fingerprints")
    if exp.expected is None:
        return done(NOT_VERIFIABLE, None, "the recorded text states no version")
    value, why = lookup(doc, exp.path)
    if why is not None:
        return done(NOT_VERIFIABLE, None, why)
    if exp.compare == "commit":
        commit = value.get("commit") if isinstance(value, dict) else None
        if not isinstance(commit, str):
            return done(NOT_VERIFIABLE, None, "the fingerprint has no git commit for this checkout")
        want = exp.expected.split()[0]
        found = commit[:12] + (" (local changes)" if value.get("dirty") else " (clean)")
        if not commit.startswith(want.lower()):
            return done(MISMATCH, found, f"recorded commit {want}, loaded checkout at {commit[:12]}")
        if "no local changes" in exp.expected and value.get("dirty"):
            return done(MISMATCH, found, "the record says no local changes; the checkout has local changes")
        return done(MATCH, found, "")
    if exp.compare == "count":
        found = str(value)
        return done(MATCH if found == exp.expected else MISMATCH, found, "")
    found = str(value)
    if not versions_match(exp.expected, found):
        return done(MISMATCH, found, "")
    notes = []
    if exp.distribution:
        dists = (lookup(doc, exp.path[:-1] + ("distributions",))[0] or {})
        names = {normalize(n) for n in dists} if isinstance(dists, dict) else set()
        if names and normalize(exp.distribution) not in names:
            return done(MISMATCH, f"{', '.join(sorted(dists))} {found}",
                        f"the record names distribution {exp.distribution}; installed is {', '.join(sorted(dists))}")
    note = precision_note(exp.expected, found)
    if note:
        notes.append(note)
    return done(MATCH, found, "; ".join(notes))


def audit(stack: dict[str, Any], fingerprint: dict[str, Any], source: str = "recipe", fingerprint_name: str = "") -> AuditReport:
    report = AuditReport(source=source, fingerprint=fingerprint_name)
    report.checks = [_check(exp, fingerprint) for exp in expectations(stack)]
    return report
