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
    return f"{x:.{places}f}"


def sci(x: float, places: int = 1) -> str:
    """3.1e-4 (no zero-padded exponent, as the docs write it)"""
    mant, exp = f"{x:.{places}e}".split("e")
    return f"{mant}e{int(exp)}"


# ---- tables whose figure cells come from the data -------------------------------------------------------------------

_NUMBER = re.compile(r"^(\*\*)?(-|[-+]?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?%?)(\*\*)?")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def set_number(cell: str, value: str) -> str:
    """``cell`` with its leading figure replaced by ``value``; bold and the words after the figure stay."""
    m = _NUMBER.match(cell)
    if not m:
        raise ValueError(f"cell {cell!r} does not start with a figure")
    bold = "**" if m.group(1) and m.group(3) else ""
    return f"{bold}{value}{bold}{cell[m.end():]}"


def table(key: Callable[[list[str]], str | None], columns: dict[int, Callable[[str], str]]) -> Callable[[str], str]:
    """A markdown table in a slot whose figure cells are the data's: for each body row, ``key(cells)`` names the
    row's data (None: a row with no figures), and ``columns[i](key)`` is column i's figure. The header, the row
    order and every other cell are the doc's."""

    def fill(text: str) -> str:
        out, body = [], False
        for line in text.split("\n"):
            if not line.startswith("|"):
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
                cells[i] = set_number(cells[i], fig(k))
            out.append("| " + " | ".join(cells) + " |")
        return "\n".join(out)

    return fill


def first_code(cells: list[str]) -> str:
    """The first `code` span of a row's first cell: the row's file or folder."""
    m = re.search(r"`([^`]+)`", cells[0])
    if not m:
        raise ValueError(f"row {cells!r} names no file in its first cell")
    return m.group(1)


# ---- benchmarks/index.yaml ------------------------------------------------------------------------------------------

def index_results() -> str:
    """benchmarks/index.yaml's list of result folders, from each folder's result.json."""
    out = []
    for folder in schema.result_folders(RESULTS):
        r = schema.load(folder)
        command = next((c for c in r.commands), "")
        out.append(f"  - path: results/{r.id}\n"
                   f"    claim: {json.dumps(r.claim)}\n"
                   f"    status: {r.status}\n"
                   f"    date: {json.dumps(r.date)}\n"
                   f"    hardware: {json.dumps(r.hardware)}\n"
                   f"    command: {json.dumps(command)}\n")
    return "".join(out)


def index() -> dict:
    return {"results": index_results()}


DOCS: dict[str, Callable[[], dict]] = {
    "benchmarks/index.yaml": index,
}
