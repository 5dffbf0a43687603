"""Reading committed benchmark result folders in the tests of their verdicts (CPU only)."""

from __future__ import annotations

import importlib.util
import json
import statistics
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

    def median_step(self, run: str, warmup: int = 8) -> float:
        """The median window step of an ``engine_steps.py`` run (its steps after ``warmup``)."""
        return statistics.median(s["step_time_s"] for s in self.json(f"{run}.json")["steps"][warmup:])

    def assert_run_table_with_median(self, runs: tuple[str, ...]) -> None:
        """Each of ``runs`` has a README row `| `NAME.json` | what | tokens/s | MFU | mean step | median step |
        final loss |` restating its file."""
        text = (self.path / "README.md").read_text()
        for run in runs:
            r = self.json(f"{run}.json")
            row = next(line for line in text.splitlines() if line.startswith(f"| `{run}.json` |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[2:] == [f"{r['tokens_per_s_per_gpu']:,.0f}", f"{100 * r['mfu']:.2f}%",
                                 f"{r['step_time_mean_s']:.4f}", f"{self.median_step(run):.4f}",
                                 f"{r['final_loss']:.5f}"], run

    def assert_verdict(self, r: dict, verdict: str) -> None:
        """``normbwd_choose.keep``'s result ``r`` as the README and ``verdict.txt`` state it: the baseline, the
        drift, twice the drift, the verdict line, and the gain by the median step."""
        text = self.text()
        assert f"{(r['with'][0] + r['with'][1]) / 2:,.0f} tokens/s" in text
        assert f"they differ by {100 * r['drift']:.2f}%, the drift" in text
        assert f"above twice the drift ({200 * r['drift']:.2f}%)" in text
        assert (f"gain +{100 * r['gain']:.2f}%, drift {100 * r['drift']:.2f}%, keep when gain > "
                f"{100 * r['threshold']:.2f}%: {verdict}") in (self.path / "verdict.txt").read_text()
        with_median = (self.median_step("with") + self.median_step("with-again")) / 2
        assert f"By the median step the gain is +{100 * (self.median_step('without') / with_median - 1):.2f}%" in text
