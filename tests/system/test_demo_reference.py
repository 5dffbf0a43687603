"""The demo's shipped reference (benchmarks/results/demo-tiny-cpu): it is a run of today's tiny-cpu recipe,
`muse-stack compare` against it passes for the runs that differ only in the CPU's arithmetic (ATen's kernels
held to AVX2, as on a CPU without AVX-512, or to no vector instructions; one thread; MKL held to AVX2), and a
demo run made here now passes it too. The tolerance is compare's default (preset bridge-function); the folder's
README shows it is several times the largest difference the CPU makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muse_stack.compare.convergence import check_convergence
from muse_stack.compare.runs import read_metrics
from muse_stack.recipes.catalogue import recipe_yaml
from muse_stack.run.pipeline import prepare

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "benchmarks" / "results" / "demo-tiny-cpu"
VARIANTS = ("cpu-avx2", "cpu-default", "one-thread", "mkl-avx2")


def _compare(golden: Path, candidate: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "muse_stack.cli", "compare", str(golden), str(candidate), "--no-plot",
                           "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_the_reference_is_a_run_of_todays_tiny_cpu_recipe():
    # a changed recipe (model, data, schedule) makes a new reference: run.sh, then render.py
    assert (DEMO / "reference" / "recipe.yaml").read_text() == recipe_yaml(prepare("tiny-cpu", [], None, None).recipe)
    for run in ("reference", *VARIANTS):
        assert (DEMO / run / "recipe.yaml").read_text() == (DEMO / "reference" / "recipe.yaml").read_text(), run


@pytest.mark.parametrize("variant", VARIANTS)
def test_compare_passes_for_every_cpu_arithmetic(tmp_path, variant):
    r = _compare(DEMO / "reference", DEMO / variant)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["passed"] and report["convergence"]["passed"]


def test_the_cpu_capability_is_what_moves_the_curve():
    ref = read_metrics(DEMO / "reference")
    fp = {run: json.loads((DEMO / run / "fingerprint.json").read_text()) for run in ("reference", *VARIANTS)}
    cap = {run: f["frameworks"]["torch"]["settings"]["cpu_capability"] for run, f in fp.items()}
    assert cap["cpu-avx2"] == "AVX2" and cap["cpu-default"] == "DEFAULT" and cap["reference"] not in ("AVX2", "DEFAULT")
    for run in VARIANTS:
        same = [r.loss for r in read_metrics(DEMO / run).steps] == [r.loss for r in ref.steps]
        assert same == (cap[run] == cap["reference"]), run
    # and a curve moved by something else than rounding fails: the same run with its losses scaled by 5%
    shifted = read_metrics(DEMO / "cpu-default")
    for row in shifted.steps:
        row.loss *= 1.05
    assert not check_convergence(ref, shifted).passed


@pytest.mark.slow
def test_a_demo_run_made_now_passes_against_the_reference(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "muse_stack.cli", "run", "tiny-cpu", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    c = _compare(DEMO / "reference", out)
    assert c.returncode == 0, c.stdout[-3000:]
