"""benchmarks/scripts/normbwd_choose.py: the one-pass norm backward's launch from kernels.py's timings, written into
the module, and the keep rule on with / with-again / without."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "scripts" / "normbwd_choose.py"
MODULE = ROOT / "muse_stack" / "engines" / "mcore" / "norm_backward.py"
sys.path.insert(0, str(SCRIPT.parent))
import normbwd_choose as nc  # noqa: E402


def kernels(times: dict[tuple[int, int, int], float]) -> dict:
    return {"post_expert_norm": {nc.LAUNCHES_KEY: [
        {"programs_per_sm": a, "num_warps": b, "rows_per_iteration": c, "backward": {"median_ms": t}}
        for (a, b, c), t in times.items()]}}


def constants(text: str) -> dict[str, str]:
    return {line.split(" = ")[0]: line.split(" = ")[1] for line in text.splitlines()
            if line.split(" = ")[0] in nc.CONSTANTS}


def test_the_fastest_launch_is_written_into_a_copy_of_the_module(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps(kernels({(1, 8, 1): 1.30, (4, 8, 2): 0.91, (2, 16, 4): 0.97})))
    copy = tmp_path / "norm_backward.py"
    shutil.copy(MODULE, copy)
    done = subprocess.run([sys.executable, str(SCRIPT), "launch", str(tmp_path / "k.json"), "--write", str(copy)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "4 program(s) per SM, 8 warps, 2 row(s) per iteration" in done.stdout
    assert constants(copy.read_text()) == {"PROGRAMS_PER_SM": "4", "NUM_WARPS": "8", "ROWS_PER_ITERATION": "2"}
    # only those three lines changed
    before, after = MODULE.read_text().splitlines(), copy.read_text().splitlines()
    assert len(before) == len(after)
    assert {a.split(" = ")[0] for a, b in zip(before, after) if a != b} <= set(nc.CONSTANTS)


def test_a_module_without_the_constants_is_refused(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("PROGRAMS_PER_SM = 2\n")
    with pytest.raises(SystemExit, match="NUM_WARPS is assigned 0 times"):
        nc.write_launch(bad, {"programs_per_sm": 1, "num_warps": 8, "rows_per_iteration": 1})


def test_kernels_without_launches_name_the_command():
    with pytest.raises(SystemExit, match="kernels.py --only post_expert_norm"):
        nc.fastest({"post_expert_norm": {}})


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
