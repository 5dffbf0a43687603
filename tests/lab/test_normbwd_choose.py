"""benchmarks/scripts/normbwd_choose.py: the one-pass norm backward's launch from kernels.py's timings, written into
the engine's launch file with the bandwidth shares into the planner's calibration (never into source), and the keep
rule on with / with-again / without."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "scripts" / "normbwd_choose.py"
LAUNCH = ROOT / "muse_stack" / "engines" / "mcore" / "launch.json"
CALIBRATION = ROOT / "muse_stack" / "plan" / "calibration.json"
sys.path.insert(0, str(SCRIPT.parent))
import normbwd_choose as nc  # noqa: E402


def kernels(times: dict[tuple[int, int, int], float]) -> dict:
    return {"device": "NVIDIA H200", "post_expert_norm": {
        "inductor default": {"backward": {"median_ms": 2.0, "gb_per_s": 1200.0}},
        nc.LAUNCHES_KEY: [{"programs_per_sm": a, "num_warps": b, "rows_per_iteration": c,
                           "backward": {"median_ms": t, "gb_per_s": 2400.0 / t}} for (a, b, c), t in times.items()]}}


def _copies(tmp_path: Path) -> tuple[Path, Path]:
    launch, cal = tmp_path / "launch.json", tmp_path / "calibration.json"
    shutil.copy(LAUNCH, launch)
    shutil.copy(CALIBRATION, cal)
    return launch, cal


def test_the_fastest_launch_and_its_shares_are_written_into_copies_of_the_data_files(tmp_path):
    made_up = tmp_path / "normbwd-x" / "kernels.json"
    made_up.parent.mkdir()
    made_up.write_text(json.dumps(kernels({(1, 8, 1): 1.30, (4, 8, 2): 0.80, (2, 16, 4): 0.97})))
    launch, shares = nc.chosen(json.loads(made_up.read_text()), made_up)
    assert launch == {"programs_per_sm": 4, "num_warps": 8, "rows_per_iteration": 2}
    # 1,200 and 3,000 GB/s over the H200's 4,800
    assert shares == {"norm_backward_bandwidth_compiled": 0.25, "norm_backward_bandwidth_one_pass": 0.625}
    launch_file, cal_file = _copies(tmp_path)
    before_launch, before_cal = json.loads(launch_file.read_text()), json.loads(cal_file.read_text())
    nc.write_chosen(made_up, "norm_backward", launch, shares, str(SCRIPT), launch_file, cal_file)
    after_launch, after_cal = json.loads(launch_file.read_text()), json.loads(cal_file.read_text())
    cmd = f"python benchmarks/scripts/normbwd_choose.py launch {made_up.as_posix()} --write"
    assert after_launch["norm_backward"] == {"value": launch, "source": made_up.parent.as_posix(), "command": cmd}
    for k, v in shares.items():
        assert after_cal["time"][k] == {"value": v, "source": made_up.parent.as_posix(), "command": cmd}
    # nothing else changed
    assert {k: v for k, v in after_launch.items() if k != "norm_backward"} == \
        {k: v for k, v in before_launch.items() if k != "norm_backward"}
    assert {k: v for k, v in after_cal["time"].items() if k not in shares} == \
        {k: v for k, v in before_cal["time"].items() if k not in shares}
    assert {k: v for k, v in after_cal.items() if k != "time"} == {k: v for k, v in before_cal.items() if k != "time"}


def test_a_launch_or_share_the_product_would_refuse_writes_neither_file(tmp_path):
    launch_file, cal_file = _copies(tmp_path)
    before = launch_file.read_bytes(), cal_file.read_bytes()
    bad = {"programs_per_sm": 1, "num_warps": 8, "rows_per_iteration": 3}
    with pytest.raises(SystemExit, match="rows_per_iteration"):
        nc.write_chosen(tmp_path / "k.json", "norm_backward", bad, {}, str(SCRIPT), launch_file, cal_file)
    assert (launch_file.read_bytes(), cal_file.read_bytes()) == before
    # a good launch with a share the planner has no field for: neither file is written
    good = {"programs_per_sm": 1, "num_warps": 8, "rows_per_iteration": 2}
    with pytest.raises(SystemExit, match="time.no_such_share is no field of TimeCalibration"):
        nc.write_chosen(tmp_path / "k.json", "norm_backward", good, {"no_such_share": 0.5}, str(SCRIPT), launch_file,
                        cal_file)
    assert (launch_file.read_bytes(), cal_file.read_bytes()) == before


def test_kernels_without_launches_name_the_command():
    with pytest.raises(SystemExit, match="kernels.py --only post_expert_norm"):
        nc.fastest({"post_expert_norm": {}})


def test_a_device_without_a_bandwidth_is_refused(tmp_path):
    k = kernels({(1, 8, 1): 1.0})
    k["device"] = "Some GPU"
    with pytest.raises(SystemExit, match="'Some GPU' is no GPU"):
        nc.chosen(k, tmp_path / "k.json")


def runs(folder: Path, a: float, b: float, without: float) -> Path:
    for name, t in (("with", a), ("with-again", b), ("without", without)):
        (folder / f"{name}.json").write_text(json.dumps({"tokens_per_s_per_gpu": t}))
    return folder


@pytest.mark.parametrize("a, b, without, kept", [
    (50_600, 50_620, 50_230, True),    # +0.76%, drift 0.04%: above 0.5%
    (50_400, 50_420, 50_230, False),   # +0.36%: below 0.5%
    (50_600, 51_200, 50_230, False),   # +1.4%, but drift 1.2%: twice it is 2.4%
    (50_000, 50_010, 50_230, False),   # slower
])
def test_the_keep_rule(tmp_path, a, b, without, kept):
    r = nc.keep(runs(tmp_path, a, b, without))
    assert r["kept"] is kept
    assert r["gain"] == pytest.approx((a + b) / 2 / without - 1)


def test_keep_writes_its_verdict_and_needs_all_three(tmp_path):
    runs(tmp_path, 50_600, 50_620, 50_230)
    assert nc.main(["keep", str(tmp_path), "--write", str(tmp_path / "v.txt")]) == 0
    assert (tmp_path / "v.txt").read_text() == "kept\n"
    (tmp_path / "without.json").unlink()
    with pytest.raises(SystemExit, match="without.json is missing"):
        nc.keep(tmp_path)
