"""The post-expert norm's one-pass backward (``muse_stack/engines/mcore/norm_backward.py``): its launch,
chosen from ``kernels.py``'s timings, and whether the engine runs it, chosen from the step (``h200.sh normbwd``).

    python benchmarks/scripts/normbwd_choose.py launch KERNELS.json [--write]
    python benchmarks/scripts/normbwd_choose.py keep DIR [--write FILE]

``launch`` takes the fastest of the launches ``kernels.py`` timed (the backward alone, median of 10 calls).
With ``--write`` it writes that launch as the kernel's (``norm_backward`` in
``muse_stack/engines/mcore/launch.json``) and the share of the HBM bandwidth each backward reached alone,
TorchInductor's and the one pass at that launch, as the planner's (``norm_backward_bandwidth_compiled`` and
``norm_backward_bandwidth_one_pass`` in ``muse_stack/plan/calibration.json``), each with KERNELS.json's
folder and this command (:mod:`datafiles`).

``keep`` reads ``with.json`` and ``with-again.json`` (``engine_steps.py`` with the one-pass backward, first
and last in one call) and ``without.json`` (the compiled chain's own backward). It applies :mod:`levers_choose`'s rule: the baseline is the mean of the two runs
with it, their relative difference is the drift, and the one-pass backward is kept when the baseline
beats the run without it by more than twice the drift and by at least 0.5%. ``--write`` writes ``kept``
or ``rejected``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import datafiles  # noqa: E402
from levers_choose import baseline, runs_tps  # noqa: E402

LAUNCHES_KEY = "one Triton pass, launches (backward alone)"
#: the kernel's entry in launch.json
KERNEL = "norm_backward"
#: the launch's fields as launch.json names them
FIELDS = ("programs_per_sm", "num_warps", "rows_per_iteration")


def fastest(kernels: dict) -> dict:
    """The launch with the least median time (the first of equals, in the order kernels.py timed them)."""
    launches = kernels.get("post_expert_norm", {}).get(LAUNCHES_KEY)
    if not launches:
        raise SystemExit(f"no launches under post_expert_norm[{LAUNCHES_KEY!r}]: run kernels.py --only post_expert_norm")
    return min(launches, key=lambda r: r["backward"]["median_ms"])


def chosen(kernels: dict, path: pathlib.Path) -> tuple[dict, dict[str, float]]:
    """(the fastest launch, {calibration field: bandwidth share}) of a kernels.py result read from ``path``:
    each backward's GB/s alone over the datasheet HBM bandwidth of the GPU it ran on, rounded as the
    planner's calibration is (:func:`datafiles.significant`)."""
    best = fastest(kernels)
    hbm = datafiles.hbm_gbps(kernels, path)
    inductor = kernels["post_expert_norm"]["inductor default"]["backward"]
    return ({f: best[f] for f in FIELDS},
            {"norm_backward_bandwidth_compiled": datafiles.significant(inductor["gb_per_s"] / hbm),
             "norm_backward_bandwidth_one_pass": datafiles.significant(best["backward"]["gb_per_s"] / hbm)})


def write_chosen(kernels_path: pathlib.Path, launch_key: str, launch: dict, shares: dict[str, float],
                 script: str, launch_file: pathlib.Path = datafiles.LAUNCH,
                 calibration_file: pathlib.Path = datafiles.CALIBRATION) -> None:
    """Write ``launch`` as kernel ``launch_key``'s in launch.json and ``shares`` into calibration.json, each
    with ``kernels_path``'s folder and the command ``script launch KERNELS --write``."""
    cmd = datafiles.command(script, "launch", kernels_path, "--write")
    source = kernels_path.parent
    # both validated before either is written
    launch_text = datafiles.launch_text(launch_key, datafiles.entry(launch, source, cmd), launch_file)
    cal_text = datafiles.calibration_text({"time": {k: datafiles.entry(v, source, cmd) for k, v in shares.items()}},
                                          calibration_file)
    datafiles.write(launch_file, launch_text)
    datafiles.write(calibration_file, cal_text)


def keep(folder: pathlib.Path) -> dict:
    """The rule applied to ``folder``'s with / with-again / without runs."""
    tps = runs_tps(folder, ("with", "with-again", "without"))
    a, b, without = tps["with"], tps["with-again"], tps["without"]
    base, drift, threshold = baseline(a, b)
    gain = base / without - 1
    return {"with": [a, b], "without": without, "drift": drift, "threshold": threshold, "gain": gain,
            "kept": gain > threshold}


def cli(argv: list[str] | None, description: str, launch) -> int:
    """The two subcommands, ``launch KERNELS [--write]`` (``launch(kernels, path, write)`` prints the fastest
    launch and, with ``write``, writes it) and ``keep DIR [--write FILE]`` (the rule's verdict, printed and
    written)."""
    ap = argparse.ArgumentParser(description=description)
    sub = ap.add_subparsers(dest="what", required=True)
    la = sub.add_parser("launch", help="the fastest launch in a kernels.json")
    la.add_argument("kernels", type=pathlib.Path)
    la.add_argument("--write", action="store_true",
                    help="write the launch into muse_stack/engines/mcore/launch.json and the bandwidth shares into "
                         "muse_stack/plan/calibration.json")
    ke = sub.add_parser("keep", help="kept or rejected, from with / with-again / without")
    ke.add_argument("folder", type=pathlib.Path)
    ke.add_argument("--write", type=pathlib.Path, help="write kept or rejected here")
    args = ap.parse_args(argv)
    if args.what == "launch":
        launch(json.loads(args.kernels.read_text()), args.kernels, args.write)
        if args.write:
            print(f"written to {datafiles.rel(datafiles.LAUNCH)} and {datafiles.rel(datafiles.CALIBRATION)}")
        return 0
    r = keep(args.folder)
    verdict = "kept" if r["kept"] else "rejected"
    print(f"with {r['with'][0]:,.0f} / {r['with'][1]:,.0f} tokens/s, without {r['without']:,.0f}: "
          f"gain {r['gain']:+.2%}, drift {r['drift']:.2%}, keep when gain > {r['threshold']:.2%}: {verdict}")
    if args.write:
        args.write.write_text(verdict + "\n")
    return 0


def write_files(kernels_path: pathlib.Path, launch_file: pathlib.Path = datafiles.LAUNCH,
                calibration_file: pathlib.Path = datafiles.CALIBRATION) -> None:
    """``launch KERNELS --write``: the fastest launch of ``kernels_path`` into launch.json, its bandwidth shares
    into calibration.json."""
    launch, shares = chosen(json.loads(kernels_path.read_text()), kernels_path)
    write_chosen(kernels_path, KERNEL, launch, shares, __file__, launch_file, calibration_file)


def _launch(kernels: dict, path: pathlib.Path, write: bool) -> None:
    best = fastest(kernels)
    launch, shares = chosen(kernels, path)
    print(f"fastest: {best['programs_per_sm']} program(s) per SM, {best['num_warps']} warps, "
          f"{best['rows_per_iteration']} row(s) per iteration: {best['backward']['median_ms']:.3f} ms; "
          + ", ".join(f"{k} {v}" for k, v in shares.items()))
    if write:
        write_files(path)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], _launch)


if __name__ == "__main__":
    raise SystemExit(main())
