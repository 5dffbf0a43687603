"""Reading committed benchmark result folders in the tests of their verdicts (CPU only)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def script(name: str) -> ModuleType:
    """A module of benchmarks/scripts/ (not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, RESULTS.parent / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Folder:
    """One result folder: its JSON files and a run's tokens/s."""

    def __init__(self, name: str) -> None:
        self.path = RESULTS / name

    def json(self, name: str) -> dict:
        return json.loads((self.path / name).read_text())

    def tps(self, run: str) -> float:
        return self.json(f"{run}.json")["tokens_per_s_per_gpu"]

    def baseline_and_drift(self) -> tuple[float, float]:
        """levers_choose.py's baseline (the mean of `shipped` and `shipped-again`) and the drift between them."""
        first, again = self.tps("shipped"), self.tps("shipped-again")
        base = (first + again) / 2
        return base, abs(first - again) / base

    def assert_verdict(self, r: dict, verdict: str) -> None:
        """``normbwd_choose.keep``'s result ``r`` is what ``verdict.txt`` records (the README's figures of the
        verdict are rendered from the runs: benchmarks/scripts/figures.py)."""
        assert (f"gain +{100 * r['gain']:.2f}%, drift {100 * r['drift']:.2f}%, keep when gain > "
                f"{100 * r['threshold']:.2f}%: {verdict}") in (self.path / "verdict.txt").read_text()
