"""Measure the used-memory terms outside the allocated estimate from the H200 runs (CPU only).

    python benchmarks/scripts/plan/fit_used.py [--json FILE] [--write]

Every run of benchmarks/ whose results.json (or benchmark JSON) has a ``device_memory`` block
(:mod:`muse_stack.machine.devmem`: ``torch.cuda.max_memory_allocated``, ``max_memory_reserved`` and
the device's used memory read through NVML at the end of the run, one process on the GPU) gives

* the allocator's reserve over allocated, ``max_reserved / max_allocated - 1``;
* what the process holds outside the caching allocator, ``device used - max reserved``: the CUDA
  context, the kernels loaded, the cuBLAS/cuDNN/TE workspaces (one GPU, so no NCCL peers).

The reserve is fitted as the mean over the runs in the recipe's default numerics that train
every parameter (the deterministic mode and adapter runs allocate differently and are listed
apart); the outside-the-allocator figure as the median over every run (it does not depend on
the workload). Nothing here reads the B200 record. ``--write`` writes both, to ``DIGITS`` significant digits,
into the planner's calibration (``used`` in ``muse_stack/plan/calibration.json``), each with
benchmarks/results/plan and this command: the defaults of ``UsedCalibration``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datafiles  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "results"
#: significant digits each measured value keeps in the calibration (a rounding of at most 0.5%)
DIGITS = 3

#: (folder or file under benchmarks/, what ran, counted in the reserve fit)
RUNS = [
    ("det/before-seed-fix/proxy-1gpu-default-a/results.json", "proxy-1gpu, default numerics, 20 steps", True),
    ("ckpt-save/ckpt-save.json", "slice-1gpu, default numerics, 72 steps with two checkpoint saves", True),
    ("det/before-seed-fix/proxy-1gpu-det-a/results.json", "proxy-1gpu, numerics.deterministic", False),
    ("det/before-seed-fix/slice-1gpu-det-a/results.json", "slice-1gpu, numerics.deterministic", False),
    ("peft-lora-slice/full/results.json", "slice-1gpu with lora-64's adapters, 20 steps", False),
]


def measure() -> dict:
    rows = []
    for rel, what, fitted in RUNS:
        doc = json.loads((BENCH / rel).read_text())
        mem = doc["device_memory"]
        rows.append({"run": rel, "what": what, "fitted": fitted, "max_allocated_gib": mem["max_allocated_gib"],
                     "max_reserved_gib": mem["max_reserved_gib"], "device_used_gib": mem["device_used_gib"],
                     "device_processes": mem.get("device_processes"),
                     "reserve_over_allocated": mem["max_reserved_gib"] / mem["max_allocated_gib"] - 1,
                     "outside_allocator_gib": mem["device_used_gib"] - mem["max_reserved_gib"]})
    fitted = [r["reserve_over_allocated"] for r in rows if r["fitted"]]
    return {"runs": rows,
            "allocator_reserve_fraction": statistics.fmean(fitted),
            "allocator_reserve_range": [min(r["reserve_over_allocated"] for r in rows),
                                        max(r["reserve_over_allocated"] for r in rows)],
            "outside_allocator_gib": statistics.median(r["outside_allocator_gib"] for r in rows),
            "outside_allocator_range_gib": [min(r["outside_allocator_gib"] for r in rows),
                                            max(r["outside_allocator_gib"] for r in rows)]}


def write_calibration(out: dict, json_out: Path | None, path: Path = datafiles.CALIBRATION) -> str:
    """Write the measurement (``out``; ``json_out``: where its JSON went) into the planner's calibration
    (``used``), each value to ``DIGITS`` significant digits, with benchmarks/results/plan and this command."""
    cmd = datafiles.command(__file__, *(("--json", json_out) if json_out else ()), "--write")
    entries = {k: datafiles.entry(datafiles.significant(out[k], DIGITS), BENCH / "plan", cmd)
               for k in ("allocator_reserve_fraction", "outside_allocator_gib")}
    return datafiles.write_calibration({"used": entries}, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write", action="store_true",
                    help="write the measurement into the planner's calibration (muse_stack/plan/calibration.json)")
    args = ap.parse_args(argv)
    out = measure()
    for r in out["runs"]:
        print(f"{r['run']:<42} reserve {r['reserve_over_allocated']:+7.2%}  outside allocator "
              f"{r['outside_allocator_gib']:5.2f} GiB  {'fitted' if r['fitted'] else 'listed'}")
    print(f"allocator reserve {out['allocator_reserve_fraction']:.2%} (runs span "
          f"{out['allocator_reserve_range'][0]:.2%} to {out['allocator_reserve_range'][1]:.2%}); outside the "
          f"allocator {out['outside_allocator_gib']:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.write:
        write_calibration(out, args.json)
        print(f"written to {datafiles.rel(datafiles.CALIBRATION)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
