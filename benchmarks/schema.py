"""The one schema of a benchmark result folder: its ``result.json``.

Every folder directly under ``benchmarks/results/`` (and under ``benchmarks/results/archive/``) is one result
and holds a ``result.json``: what the result shows (``claim``), what was measured and where each figure lives
(``measured``: a metric, its unit and the JSON pointer of its value in the folder's own files), the hardware,
the stack fingerprint, the method, the commands that made it, the date and whether it is still current. The
figures themselves stay in the files the measurement wrote (``results.json`` of ``muse-stack run``, an
``engine_steps.py`` JSON, a profile, ...): ``figures`` names every one of them, ``runs`` every run folder
inside, so a file nobody describes is an error.

``results.json`` is the runner's own output (``muse-stack run`` writes it in every run folder); ``result.json``
is the lab's header beside it, so the two never share a name or a shape.

    python benchmarks/schema.py            # checks every result folder, exit 1 with each problem named
    python benchmarks/schema.py --json-schema   # the JSON schema of result.json
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
ARCHIVE = "archive"
REPO = BENCH.parent
SCHEMA = "muse-stack-benchmark-result/1"
NOT_RECORDED = "not recorded"
NOT_APPLICABLE = "not applicable"
#: files any result folder may hold without naming them in ``figures``
STANDARD = {"README.md", "run.sh", "result.json"}

Unknown = Literal["not recorded", "not applicable"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Metric(_Strict):
    """One measured quantity: its name, unit and where its value lives."""

    name: Annotated[str, Field(min_length=1, description="what was measured, as the source names it")]
    unit: Annotated[str, Field(min_length=1, description="its unit: tokens/s, s, GiB, fraction of peak, ...")]
    source: Annotated[
        str,
        Field(
            pattern=r"^[^#\s]+(#/.*)?$",
            description="FILE#/json/pointer: FILE relative to the result folder, a glob allowed (every match must hold "
            "the value; a .jsonl FILE is read as a list of its lines); FILE alone for a text file",
        ),
    ]


class Method(_Strict):
    """How the figures were taken, as the folder records it."""

    steps: int | Unknown = Field(description="training steps per run")
    warmup_steps: int | Unknown = Field(description="steps before the measurement window")
    window: str = Field(min_length=1, description="the steps measured, e.g. 'steps 11-30'")
    repeats: str = Field(min_length=1, description="how many runs of each case, and in what order")
    how: str = Field(min_length=1, description="the method in one or two sentences")


class Result(_Strict):
    """``result.json``: the common header of one result folder."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["muse-stack-benchmark-result/1"] = Field(alias="schema")
    id: str = Field(pattern=r"^(archive/)?[a-z0-9][a-z0-9.-]*$", description="the folder, relative to results/")
    claim: str = Field(min_length=20, max_length=400, description="one sentence: what this result shows")
    status: str = Field(pattern=r"^(current|superseded-by (archive/)?[a-z0-9][a-z0-9.-]*)$")
    date: str = Field(
        pattern=r"^(\d{4}-\d{2}-\d{2}( to \d{4}-\d{2}-\d{2})?|not recorded)$",
        description="the day (or first and last day) the measurement ran",
    )
    hardware: str = Field(min_length=3, description="the machine, as the fingerprint records it")
    fingerprint: str = Field(
        min_length=1, description="the stack fingerprint file (a glob for one per run), " "or 'not recorded'"
    )
    commands: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, description="the commands that made it")
    method: Union[Method, Literal["not applicable"]]
    measured: list[Metric] = Field(min_length=1)
    figures: dict[str, str] = Field(
        default_factory=dict, description="every data file of the folder (a name or " "glob) -> what it holds"
    )
    runs: dict[str, str] = Field(default_factory=dict, description="every run folder inside -> what it is")

    @model_validator(mode="after")
    def _holds_something(self) -> "Result":
        if not self.figures and not self.runs:
            raise ValueError("a result holds data: name its files in figures or its run folders in runs")
        return self

    @field_validator("claim")
    @classmethod
    def _one_sentence(cls, claim: str) -> str:
        if not claim.endswith("."):
            raise ValueError("a claim is one sentence ending with a full stop")
        if re.search(r"[.;]\s+[A-Z]", claim):
            raise ValueError("a claim is one sentence: split the rest into the README")
        return claim

    @field_validator("figures", "runs")
    @classmethod
    def _described(cls, entries: dict[str, str]) -> dict[str, str]:
        for name, what in entries.items():
            if not what.strip():
                raise ValueError(f"{name}: say what it holds")
        return entries


def result_folders(results: Path = RESULTS) -> list[Path]:
    """Every result folder: each folder under results/ but archive/ itself, and each under results/archive/."""
    tops = [p for p in sorted(results.iterdir()) if p.is_dir() and not p.name.startswith((".", "__"))]
    out = [p for p in tops if p.name != ARCHIVE]
    if (results / ARCHIVE).is_dir():
        out += [p for p in sorted((results / ARCHIVE).iterdir()) if p.is_dir()]
    return out


def load(folder: Path) -> Result:
    """The folder's result.json, validated; a SystemExit naming the file and each bad field otherwise."""
    path = folder / "result.json"
    if not path.is_file():
        raise SystemExit(f"{path}: missing; every result folder needs a result.json ({__doc__.splitlines()[0]})")
    try:
        return Result.model_validate_json(path.read_text())
    except ValidationError as e:
        fields = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise SystemExit(f"{path}: {fields}") from None


def _pointer(doc: object, pointer: str) -> object:
    """RFC 6901: the value at ``pointer`` ('/a/0/b'), KeyError if there is none."""
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(doc, list):
            if not token.isdigit() or int(token) >= len(doc):
                raise KeyError(token)
            doc = doc[int(token)]
        elif isinstance(doc, dict) and token in doc:
            doc = doc[token]
        else:
            raise KeyError(token)
    return doc


def values(folder: Path, source: str) -> dict[str, object]:
    """Every value a metric's ``source`` names: matched file (relative to ``folder``) -> value (a text file's
    text where the source has no pointer)."""
    pattern, _, pointer = source.partition("#")
    files = sorted(f for f in folder.glob(pattern) if f.is_file())
    if not files:
        raise KeyError(f"no file matches {pattern}")
    out: dict[str, object] = {}
    for f in files:
        if not pointer:
            out[f.relative_to(folder).as_posix()] = f.read_text()
            continue
        if f.suffix == ".jsonl":
            doc = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        else:
            doc = json.loads(f.read_text())
        try:
            out[f.relative_to(folder).as_posix()] = _pointer(doc, pointer)
        except KeyError as e:
            raise KeyError(f"{f.relative_to(folder)} has no {pointer} (at {e})") from None
    return out


def _fingerprint_days(folder: Path, pattern: str) -> list[str]:
    days = []
    for f in sorted(folder.glob(pattern)):
        capture = json.loads(f.read_text()).get("capture", {})
        if "captured_at" in capture:
            days.append(capture["captured_at"][:10])
    return days


def _command_paths(command: str) -> list[str]:
    """Repository files a command names (words that start with benchmarks/, tests/, recipes/ or data/)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    out = []
    for w in words:
        w = w.split("=", 1)[-1] if "=" in w and not w.startswith(("benchmarks/", "tests/")) else w
        if re.match(r"^(benchmarks|tests|recipes|data)/[\w./-]+$", w) and "*" not in w:
            out.append(w.rstrip("/"))
    return out


def problems(folder: Path, known: set[str] | None = None, results: Path = RESULTS) -> list[str]:
    """What is wrong with one result folder's result.json against the folder; empty when nothing is.
    ``known``: every result id (for status), or None to skip that check."""
    rel = folder.relative_to(results).as_posix()
    try:
        r = load(folder)
    except SystemExit as e:
        return [str(e)]
    out: list[str] = []

    def bad(msg: str) -> None:
        out.append(f"results/{rel}/result.json: {msg}")

    if r.id != rel:
        bad(f"id {r.id!r} is not the folder's path {rel!r}")
    archived = rel.startswith(f"{ARCHIVE}/")
    if archived != r.status.startswith("superseded-by "):
        bad(
            f"status {r.status!r}: a superseded result lives under results/{ARCHIVE}/ and only it"
            if archived
            else f"status {r.status!r}: move a superseded result under results/{ARCHIVE}/"
        )
    if r.status.startswith("superseded-by ") and known is not None:
        target = r.status.split(" ", 1)[1]
        if target not in known or target == rel:
            bad(f"status names {target!r}, which is not another result folder")
    # the fingerprint, and the date it records
    if r.fingerprint != NOT_RECORDED:
        if not list(folder.glob(r.fingerprint)):
            bad(f"fingerprint {r.fingerprint!r} matches no file")
        for f in sorted(folder.glob(r.fingerprint)):
            for name in json.loads(f.read_text()).get("gpu", {}).get("names", []):
                if name not in r.hardware:
                    bad(f"hardware {r.hardware!r} does not name {name}, the GPU {f.relative_to(folder)} records")
        days = _fingerprint_days(folder, r.fingerprint)
        if days and r.date != NOT_RECORDED:
            first, _, last = r.date.partition(" to ")
            last = last or first
            if not (first <= min(days) and max(days) <= last):
                bad(f"date {r.date!r}, but the fingerprints were captured {min(days)} to {max(days)}")
    if r.date != NOT_RECORDED:
        for day in r.date.split(" to "):
            try:
                dt.date.fromisoformat(day)
            except ValueError:
                bad(f"date {day!r} is not a day")
    # a folder that is one runner's run: its method is the one the run recorded
    run = folder / "results.json"
    if isinstance(r.method, Method) and run.is_file():
        ran = json.loads(run.read_text())
        if "steps_completed" in ran and ran.get("status") == "completed":
            window = ran.get("window") or []
            recorded = (ran["steps_completed"], ran.get("warmup_steps"))
            if (r.method.steps, r.method.warmup_steps) != recorded:
                bad(
                    f"method says {r.method.steps} steps, {r.method.warmup_steps} warm-up; results.json records "
                    f"{recorded[0]} and {recorded[1]}"
                )
            if len(window) == 2 and not all(str(step) in r.method.window for step in window):
                bad(f"method's window {r.method.window!r} is not results.json's steps {window}")
    for command in r.commands:
        for path in _command_paths(command):
            if not (REPO / path).exists():
                bad(f"command {command!r} names {path}, which is not in the repository")
    for m in r.measured:
        try:
            got = values(folder, m.source)
        except (KeyError, json.JSONDecodeError) as e:
            bad(f"measured {m.name}: source {m.source}: {e}")
            continue
        for f, v in got.items():
            if v is None or isinstance(v, (dict, list, str)) and not v:
                bad(f"measured {m.name}: {f} holds no value at {m.source.partition('#')[2] or 'all'}")
    # every file described, every description a file
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    dirs = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    covered = set(STANDARD)
    patterns = [*r.figures, r.fingerprint]
    for pattern in r.figures:
        hits = [f for f in files if fnmatch.fnmatchcase(f, pattern)]
        if not hits:
            bad(f"figures names {pattern!r}, which matches no file of the folder")
        covered.update(hits)
    for f in files:
        if f not in covered and not any(fnmatch.fnmatchcase(f, p) for p in patterns):
            bad(f"{f} is not described: name it in figures")
    for d in dirs:
        if d not in r.runs:
            bad(f"{d}/ is not described: name it in runs")
    for d in r.runs:
        if d not in dirs:
            bad(f"runs names {d}/, which is not a folder here")
    return out


def check_all(results: Path = RESULTS) -> list[str]:
    folders = result_folders(results)
    known = {p.relative_to(results).as_posix() for p in folders}
    return [p for folder in folders for p in problems(folder, known, results)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--json-schema"]:
        print(json.dumps(Result.model_json_schema(by_alias=True), indent=2))
        return 0
    if argv:
        print("usage: python benchmarks/schema.py [--json-schema]", file=sys.stderr)
        return 2
    found = check_all()
    for p in found:
        print(p, file=sys.stderr)
    print(f"{len(result_folders())} result folders, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
