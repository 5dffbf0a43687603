"""Reading committed benchmark result folders in the tests that restate their READMEs (CPU only)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def script(name: str) -> ModuleType:
    """A module of benchmarks/scripts/ (not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, RESULTS.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Folder:
    """One result folder: its JSON files, a run's tokens/s, and its README as one line of words."""

    def __init__(self, name: str) -> None:
        self.path = RESULTS / name

    def json(self, name: str) -> dict:
        return json.loads((self.path / name).read_text())

    def tps(self, run: str) -> float:
        return self.json(f"{run}.json")["tokens_per_s_per_gpu"]

    def text(self) -> str:
        return " ".join((self.path / "README.md").read_text().split())

    def baseline_and_drift(self) -> tuple[float, float]:
        """levers_choose.py's baseline (the mean of `shipped` and `shipped-again`) and the drift between them."""
        first, again = self.tps("shipped"), self.tps("shipped-again")
        base = (first + again) / 2
        return base, abs(first - again) / base

    def assert_run_table(self, runs: tuple[str, ...]) -> None:
        """The README's table of runs (`| `NAME.json` | what | tokens/s | MFU | step (s) | final loss |`) lists
        `runs` in order, each row restating its file."""
        text = (self.path / "README.md").read_text()
        rows = [r for r in text.splitlines() if r.startswith("| `") and ".json`" in r]
        assert [r.split("`")[1] for r in rows] == [f"{run}.json" for run in runs]
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            r = self.json(cells[0].strip("`"))
            assert cells[2:] == [f"{r['tokens_per_s_per_gpu']:,.0f}", f"{100 * r['mfu']:.2f}%",
                                 f"{r['step_time_mean_s']:.4f}", f"{r['final_loss']:.5f}"], cells[0]
