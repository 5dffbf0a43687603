"""The product reads its measured values from its data files: the planner's calibration
(muse_stack/plan/calibration.json) and the Triton kernels' launches (muse_stack/engines/mcore/launch.json). A changed
value in a copy changes what the planner prices and what the kernels launch; a file the product cannot use is an
InputError naming the file and the field. CPU only; nothing is timed. (That the files hold what the lab computes from
the committed results is tests/lab/test_benchmarks_datafiles.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from muse_stack.plan import calibration as calibration_file
from muse_stack.plan.cost import TimeCalibration
from muse_stack.plan.memory import Calibration
from muse_stack.plan.planner import make_plan
from muse_stack.plan.save import SaveCalibration
from muse_stack.plan.used import UsedCalibration
from muse_stack.recipes.catalogue import load_recipe
from muse_stack.util.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "muse_stack" / "plan" / "calibration.json"
LAUNCH = ROOT / "muse_stack" / "engines" / "mcore" / "launch.json"
#: the same float64 formula with one factor changed: rounding only (~1e-16 relative per operation)
REL = 1e-12


def _copy(tmp_path: Path, name: str, edit) -> Path:
    """A copy of the committed calibration.json with ``edit`` applied, at a path of its own (the file is read once
    per path)."""
    data = json.loads(CALIBRATION.read_text())
    edit(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _time():
    plan, _ = make_plan(load_recipe("slice-1gpu"))
    return plan.time


def test_the_defaults_are_the_files_values():
    data = json.loads(CALIBRATION.read_text())
    # every fitted or measured field has its entry; those that are neither (a policy, a count of bytes, a
    # published figure, a description) are the code's
    for section, model, code in (("time", TimeCalibration, {"link_efficiency", "source"}),
                                 ("memory", Calibration, {"logits_bytes", "headroom_fraction", "source"}),
                                 ("used", UsedCalibration, {"allocator_reserve_source", "ring_channels",
                                                            "p2p_channels_per_peer", "simple_mib", "ll128_mib",
                                                            "ll_mib"}),
                                 ("checkpoint", SaveCalibration, set())):
        entries, cal = data[section], model()
        assert {k: getattr(cal, k) for k in entries} == {k: e["value"] for k, e in entries.items()}, section
        assert set(model.model_fields) - set(entries) == code, section


def test_a_changed_memory_calibration_changes_the_plan(tmp_path, monkeypatch):
    before, _ = make_plan(load_recipe("slice-1gpu"))
    stage = before.memory[0]
    data = json.loads(CALIBRATION.read_text())
    factor = data["memory"]["compiled_activation_factor"]["value"]  # slice-1gpu's chains are compiled
    outside = data["used"]["outside_allocator_gib"]["value"]

    def edit(d):
        d["memory"]["compiled_activation_factor"]["value"] = 2 * factor
        d["used"]["outside_allocator_gib"]["value"] = outside + 1.0

    monkeypatch.setattr(calibration_file, "FILE", _copy(tmp_path, "memory.json", edit))
    after, _ = make_plan(load_recipe("slice-1gpu"))
    # the peak grows by the activations once more, the used memory by that and the 1 GiB outside the allocator
    grown = factor * stage.activations_gib
    assert after.memory[0].total_gib == pytest.approx(stage.total_gib + grown, rel=REL)
    assert after.used.outside_allocator_gib == outside + 1.0
    assert after.used.used_gib > before.used.used_gib + 1.0


def test_a_changed_efficiency_changes_the_plan(tmp_path, monkeypatch):
    before = _time()
    old = json.loads(CALIBRATION.read_text())["time"]["gemm_efficiency_dense"]["value"]

    def halve(d):
        d["time"]["gemm_efficiency_dense"]["value"] = old / 2

    monkeypatch.setattr(calibration_file, "FILE", _copy(tmp_path, "halved.json", halve))
    after = _time()
    assert TimeCalibration().gemm_efficiency_dense == old / 2
    # the dense GEMMs' term is their roofline time over the efficiency: twice as long; the other terms stay
    assert after.terms_s["dense_gemm"] == pytest.approx(2 * before.terms_s["dense_gemm"], rel=REL)
    assert after.terms_s["expert_gemm"] == before.terms_s["expert_gemm"]
    assert after.step_s > before.step_s


@pytest.mark.parametrize("edit, field, says", [
    (lambda d: d["time"]["layer_overhead_s"].update(value="fast"), "time.layer_overhead_s.value", "valid number"),
    (lambda d: d["time"]["remainder_passes"].update(value=-1.0), "time.remainder_passes.value", ">= 0"),
    (lambda d: d["time"]["attention_efficiency"].update(value=0.0), "time", "time.attention_efficiency.value is 0.0"),
    (lambda d: d["time"]["adam_bandwidth_te"].pop("command"), "time.adam_bandwidth_te.command", "Field required"),
    (lambda d: d["time"].pop("microbatch_overhead_s"), "time.microbatch_overhead_s", "is missing"),
    (lambda d: d["time"].update(gemm_efficiency=d["time"]["gemm_efficiency_dense"]), "time.gemm_efficiency",
     "no field of TimeCalibration (plan/cost.py)"),
    (lambda d: d.pop("used"), "used", "Field required"),
])
def test_a_calibration_the_planner_cannot_use_names_the_file_and_field(tmp_path, monkeypatch, edit, field, says):
    path = _copy(tmp_path, "bad.json", edit)
    monkeypatch.setattr(calibration_file, "FILE", path)
    with pytest.raises(InputError) as e:
        TimeCalibration()
        UsedCalibration()
    assert e.value.field == field and str(path) in e.value.message and says in e.value.message
    assert e.value.exit_code == 3


def test_the_cli_reports_a_broken_calibration(tmp_path, monkeypatch, cli):
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    monkeypatch.setattr(calibration_file, "FILE", path)
    rc, out, err = cli("plan", "slice-1gpu")
    assert rc == 3
    assert f"{path} is not readable JSON" in out + err and "restore calibration.json" in out + err
    monkeypatch.setattr(calibration_file, "FILE", tmp_path / "absent.json")
    rc, out, err = cli("plan", "slice-1gpu")
    assert rc == 3 and "absent.json is missing" in out + err


# ---- the kernels' launches ---------------------------------------------------------------------------------

#: run in a fresh process (the kernels read their launch when imported): point the launch file at argv[1], import
#: both kernels, and record what each passes to its Triton kernel (the kernel itself replaced by a recorder)
PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from types import SimpleNamespace
    import torch
    import muse_stack.engines.mcore.launch as launch
    launch.FILE = Path(sys.argv[1])
    from muse_stack.engines.mcore import adam_step, norm_backward

    seen = {}
    class Recorder:
        def __init__(self, name):
            self.name = name
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen[self.name] = {k: v for k, v in kwargs.items() if k in ("BLOCK", "ROWS", "num_warps")}
            return run

    adam_step._adam = Recorder("adam")
    t = torch.zeros(4)
    table = SimpleNamespace(bases=(t, t, t, t, t), rows=torch.zeros(2, adam_step.ROW, dtype=torch.int64), align=1)
    group = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "lr": 1e-4}
    adam_step._launch(table, group, SimpleNamespace(adam_w_mode=True), 1.0, 1.0, True)
    norm_backward._backward = Recorder("norm")
    x = torch.zeros(8, 16)
    norm_backward.backward(x, torch.zeros(16), torch.zeros(8), x, 1e-8)
    nb = norm_backward
    print(json.dumps({"adam": [adam_step.PROGRAMS_PER_SM, adam_step.NUM_WARPS, adam_step.BLOCK],
                      "norm": [nb.PROGRAMS_PER_SM, nb.NUM_WARPS, nb.ROWS_PER_ITERATION], "seen": seen}))
""")


def _probe(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", PROBE, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)


def _launch_copy(tmp_path: Path, adam: dict, norm: dict) -> Path:
    data = json.loads(LAUNCH.read_text())
    data["adam_step"]["value"].update(adam)
    data["norm_backward"]["value"].update(norm)
    path = tmp_path / "launch.json"
    path.write_text(json.dumps(data))
    return path


def test_the_kernels_launch_what_the_file_says(tmp_path):
    pytest.importorskip("triton")
    committed = json.loads(LAUNCH.read_text())
    adam = {"programs_per_sm": 16, "num_warps": 4, "block": 512}
    norm = {"programs_per_sm": 4, "num_warps": 16, "rows_per_iteration": 4}
    assert adam != committed["adam_step"]["value"] and norm != committed["norm_backward"]["value"]
    done = _probe(_launch_copy(tmp_path, adam, norm))
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["adam"] == [16, 4, 512] and got["norm"] == [4, 16, 4]
    # what reaches Triton: the Adam step's block and warps; the norm backward's rows per iteration (its warps and
    # programs apply on a GPU only) beside its block, the row's width to a power of two
    assert got["seen"] == {"adam": {"BLOCK": 512, "num_warps": 4}, "norm": {"ROWS": 4, "BLOCK": 16}}


@pytest.mark.parametrize("adam, norm, field, says", [
    ({"num_warps": 3}, {}, "adam_step.value.num_warps", "power of two"),
    ({}, {"rows_per_iteration": 0}, "norm_backward.value.rows_per_iteration", "greater than 0"),
    ({}, {"programs_per_sm": 2.5}, "norm_backward.value.programs_per_sm", "valid integer"),
])
def test_a_launch_the_kernels_cannot_use_names_the_file_and_field(tmp_path, monkeypatch, adam, norm, field, says):
    from muse_stack.engines.mcore import launch

    path = _launch_copy(tmp_path, adam, norm)
    monkeypatch.setattr(launch, "FILE", path)
    with pytest.raises(InputError) as e:
        launch.launches()
    assert e.value.field == field and str(path) in e.value.message and says in e.value.message


def test_a_block_that_does_not_divide_a_work_item_stops_the_import(tmp_path):
    """The one check of the Adam step's own (a work item is CHUNK elements): its import names the file and field."""
    path = _launch_copy(tmp_path, {"block": 131072}, {})
    done = _probe(path)
    assert done.returncode != 0
    assert "InputError" in done.stderr and "adam_step.value.block = 131072" in done.stderr
    assert f"{path}: adam_step.value.block does not divide a work item of 65536 elements" in done.stderr
