"""The engine's Triton Adam step (``muse_stack/engines/mcore/adam_step.py``): its launch, chosen from
``kernels.py``'s timings, and whether the engine runs it, chosen from the step (``h200.sh adam``).

    python benchmarks/scripts/adam_choose.py launch KERNELS.json [--write]
    python benchmarks/scripts/adam_choose.py keep DIR [--write FILE]

``launch`` takes the fastest of the launches ``kernels.py --only adam`` timed (TE's FusedAdam over one MoE
layer's experts stepped by the Triton step, median of 5 calls). With ``--write`` it writes that launch as the
kernel's (``adam_step`` in ``muse_stack/engines/mcore/launch.json``) and the share of the HBM bandwidth each
step reached alone, TE's ``multi_tensor_adam`` at its default chunk and the Triton step at that launch, as the
planner's (``adam_bandwidth_te`` and ``adam_bandwidth_triton`` in ``muse_stack/plan/calibration.json``), each
with KERNELS.json's folder and this command (:mod:`datafiles`).

``keep`` reads ``with.json`` and ``with-again.json`` (``engine_steps.py`` as shipped, the Triton step on, first
and last in one call) and ``without.json`` (``--te-adam``: TE's multi_tensor_adam), and applies
:mod:`levers_choose`'s rule as ``normbwd_choose.py keep`` does. ``--write`` writes ``kept`` or ``rejected``.
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import datafiles  # noqa: E402
from normbwd_choose import cli, write_chosen  # noqa: E402

LAUNCHES_KEY = "one Triton launch, launches"
#: the kernel's entry in launch.json
KERNEL = "adam_step"
#: the launch's fields as launch.json names them
FIELDS = ("programs_per_sm", "num_warps", "block")


def fastest(kernels: dict) -> dict:
    """The launch with the least median time (the first of equals, in the order kernels.py timed them)."""
    launches = kernels.get("adam", {}).get(LAUNCHES_KEY)
    if not launches:
        raise SystemExit(f"no launches under adam[{LAUNCHES_KEY!r}]: run kernels.py --only adam")
    return min(launches, key=lambda r: r["step"]["median_ms"])


def chosen(kernels: dict, path: pathlib.Path) -> tuple[dict, dict[str, float]]:
    """(the fastest launch, {calibration field: bandwidth share}) of a kernels.py result read from ``path``:
    TE's step at its default chunk and the Triton step at that launch, each one's GB/s alone over the
    datasheet HBM bandwidth of the GPU it ran on, rounded as the planner's calibration is."""
    best = fastest(kernels)
    hbm = datafiles.hbm_gbps(kernels, path)
    adam = kernels["adam"]
    te = adam[f"chunk {adam['default_chunk_size']}"]
    return ({f: best[f] for f in FIELDS},
            {"adam_bandwidth_te": datafiles.significant(te["gb_per_s"] / hbm),
             "adam_bandwidth_triton": datafiles.significant(best["step"]["gb_per_s"] / hbm)})


def write_files(kernels_path: pathlib.Path, launch_file: pathlib.Path = datafiles.LAUNCH,
                calibration_file: pathlib.Path = datafiles.CALIBRATION) -> None:
    """``launch KERNELS --write``: the fastest launch of ``kernels_path`` into launch.json, its bandwidth shares
    into calibration.json."""
    launch, shares = chosen(json.loads(kernels_path.read_text()), kernels_path)
    write_chosen(kernels_path, KERNEL, launch, shares, __file__, launch_file, calibration_file)


def _launch(kernels: dict, path: pathlib.Path, write: bool) -> None:
    best = fastest(kernels)
    launch, shares = chosen(kernels, path)
    te = min(v["median_ms"] for k, v in kernels["adam"].items() if k.startswith("chunk "))
    print(f"fastest: {best['programs_per_sm']} program(s) per SM, {best['num_warps']} warps, "
          f"{best['block']} elements per iteration: {best['step']['median_ms']:.3f} ms "
          f"({best['step']['gb_per_s']:,.0f} GB/s); TE's fastest chunk: {te:.3f} ms; "
          + ", ".join(f"{k} {v}" for k, v in shares.items()))
    if write:
        write_files(path)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], _launch)


if __name__ == "__main__":
    raise SystemExit(main())
