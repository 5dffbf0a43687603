"""The product's data files are what the lab computes from the committed results: one copy, one derivation.

Every entry of muse_stack/plan/calibration.json and muse_stack/engines/mcore/launch.json is rewritten, from copies
whose every value, folder and command is wrong, by the functions the commands the entries name run:

* ``normbwd_choose.py launch benchmarks/results/normbwd/kernels.json --write`` and ``adam_choose.py launch
  benchmarks/results/adam/kernels.json --write``: each kernel's launch and bandwidth shares;
* ``embedgrad_choose.py benchmarks/results/embedgrad --ship``: the norm backward the engine ships;
* ``plan/fit.py --json benchmarks/results/plan/fit.json --write`` and ``plan/fit_used.py --json
  benchmarks/results/plan/fit_used.json --write``: the memory calibration, fitted and measured here from the
  committed runs;
* ``plan/fit_save.py --write``: the checkpoint write rate, from benchmarks/results/ckpt-save's synchronous save;
* ``plan/fit_host.py --write``: the host time of an ungraphed MoE layer, from benchmarks/results/host-sync-probe;
* ``plan/fit_time.py --sweep benchmarks/results/plan-sweep/runs --json benchmarks/results/plan-sweep/fit.json
  --write``: the step-time calibration, from the sweep's fit as committed (tests/unit/test_plan_cost.py checks that
  fit.json is what fit_time.py computes from the runs) and the older runs' fit it holds (PRIOR, read from
  benchmarks/results/plan/fit_time.json).

The result is the committed files byte for byte. CPU only; nothing is timed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from bench_results import RESULTS, script

ROOT = RESULTS.parents[1]
CALIBRATION = ROOT / "muse_stack" / "plan" / "calibration.json"
LAUNCH = ROOT / "muse_stack" / "engines" / "mcore" / "launch.json"


def _plan_script(name: str):
    spec = importlib.util.spec_from_file_location(f"plan_{name}_datafiles",
                                                  ROOT / "benchmarks" / "scripts" / "plan" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wrong(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of both files with every entry wrong (yet valid to the product)."""
    cal = json.loads(CALIBRATION.read_text())
    for e in (*cal["time"].values(), *cal["memory"].values(), *cal["used"].values(), *cal["checkpoint"].values(),
              *(e for k, e in cal["scale"].items() if k.startswith("ungraphed_host_"))):
        e.update(value=1.0, source="nowhere", command="nothing")
    launch = json.loads(LAUNCH.read_text())
    for e in launch.values():
        e.update(value={k: 1 for k in e["value"]}, source="nowhere", command="nothing")
    paths = tmp_path / "calibration.json", tmp_path / "launch.json"
    paths[0].write_text(json.dumps(cal))
    paths[1].write_text(json.dumps(launch))
    return paths


def test_the_commands_rewrite_the_committed_data_files_byte_for_byte(tmp_path):
    cal, launch = _wrong(tmp_path)
    assert cal.read_bytes() != CALIBRATION.read_bytes() and launch.read_bytes() != LAUNCH.read_bytes()
    script("normbwd_choose").write_files(RESULTS / "normbwd" / "kernels.json", launch, cal)
    script("adam_choose").write_files(RESULTS / "adam" / "kernels.json", launch, cal)
    plan = RESULTS / "plan"
    fit = _plan_script("fit")
    fit.write_calibration(fit.fit(), plan / "fit.json", cal)
    fit_used = _plan_script("fit_used")
    fit_used.write_calibration(fit_used.measure(), plan / "fit_used.json", cal)
    fit_save = _plan_script("fit_save")
    fit_save.write_calibration(fit_save.measure(), cal)
    fit_host = _plan_script("fit_host")
    fit_host.write_calibration(fit_host.fit(), cal)
    sweep = RESULTS / "plan-sweep"
    _plan_script("fit_time").write_calibration(json.loads((sweep / "fit.json").read_text()), sweep / "runs",
                                               sweep / "fit.json", cal)
    assert launch.read_text() == LAUNCH.read_text()
    assert cal.read_text() == CALIBRATION.read_text()


def test_each_entry_names_a_committed_folder_and_a_script_of_the_lab():
    """A renamed result folder or script leaves no entry pointing nowhere: rerun the entry's command."""
    cal = json.loads(CALIBRATION.read_text())
    for e in [*cal["time"].values(), *cal["memory"].values(), *cal["used"].values(), *cal["checkpoint"].values(),
              *cal["scale"].values(), *json.loads(LAUNCH.read_text()).values()]:
        assert (ROOT / e["source"]).is_dir(), e["source"]
        python, path, *_ = e["command"].split()
        assert python == "python" and path.startswith("benchmarks/scripts/") and (ROOT / path).is_file(), e["command"]


def test_the_host_fit_is_a_least_squares_line_through_the_probes():
    """fit_host's line is exact on points on a line, and its fit of the committed probes leaves residuals far below
    the host times themselves (the form holds: a line in local experts per pass and precision)."""
    fit_host = _plan_script("fit_host")
    a, b = fit_host.line([4.0, 16.0, 64.0], [1.0 + 0.5 * x for x in (4.0, 16.0, 64.0)])
    assert (a, b) == (1.0, 0.5)
    out = fit_host.fit()
    for key, residuals in out["residuals_s"].items():
        host = out[f"{key}_s"] + 16 * out[f"{key}_per_expert_s"]  # the line at 16 local experts (EP 8's)
        # every probe within half the line's value there: the scatter between models of one expert count
        assert max(abs(r) for r in residuals.values()) < 0.5 * host, key
        assert out[f"{key}_per_expert_s"] > 0, key  # more local experts, more host work
