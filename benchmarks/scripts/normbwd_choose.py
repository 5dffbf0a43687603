"""The post-expert norm's one-pass backward (``muse_stack/engines/mcore/norm_backward.py``): its launch,
chosen from ``kernels.py``'s timings, and whether the engine runs it, chosen from the step (``h200.sh normbwd``).

    python3 benchmarks/scripts/normbwd_choose.py launch KERNELS.json [--write muse_stack/engines/mcore/norm_backward.py]
    python3 benchmarks/scripts/normbwd_choose.py keep DIR [--write FILE]

``launch`` takes the fastest of the launches ``kernels.py`` timed (the backward alone, median of 10 calls)
and with ``--write`` sets the module's ``PROGRAMS_PER_SM``, ``NUM_WARPS`` and ``ROWS_PER_ITERATION`` to it.

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
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from levers_choose import baseline, runs_tps  # noqa: E402

LAUNCHES_KEY = "one Triton pass, launches (backward alone)"
CONSTANTS = ("PROGRAMS_PER_SM", "NUM_WARPS", "ROWS_PER_ITERATION")


def fastest(kernels: dict) -> dict:
    """The launch with the least median time (the first of equals, in the order kernels.py timed them)."""
    launches = kernels.get("post_expert_norm", {}).get(LAUNCHES_KEY)
    if not launches:
        raise SystemExit(f"no launches under post_expert_norm[{LAUNCHES_KEY!r}]: run kernels.py --only post_expert_norm")
    return min(launches, key=lambda r: r["backward"]["median_ms"])


def write_constants(module: pathlib.Path, values: dict[str, int]) -> str:
    """Set top-level integer constants of ``module``; each must be assigned once at the top level."""
    text = module.read_text()
    for name, value in values.items():
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {int(value)}", text, flags=re.M)
        if n != 1:
            raise SystemExit(f"{module}: {name} is assigned {n} times at the top level, not once")
    module.write_text(text)
    return text


def write_launch(module: pathlib.Path, launch: dict) -> str:
    """Set the module's launch constants to ``launch``."""
    return write_constants(module, {"PROGRAMS_PER_SM": launch["programs_per_sm"], "NUM_WARPS": launch["num_warps"],
                                    "ROWS_PER_ITERATION": launch["rows_per_iteration"]})


def keep(folder: pathlib.Path) -> dict:
    """The rule applied to ``folder``'s with / with-again / without runs."""
    tps = runs_tps(folder, ("with", "with-again", "without"))
    a, b, without = tps["with"], tps["with-again"], tps["without"]
    base, drift, threshold = baseline(a, b)
    gain = base / without - 1
    return {"with": [a, b], "without": without, "drift": drift, "threshold": threshold, "gain": gain,
            "kept": gain > threshold}


def cli(argv: list[str] | None, description: str, module: str, launch) -> int:
    """The two subcommands, ``launch KERNELS [--write MODULE]`` (``launch(kernels, write)`` prints and writes the
    fastest launch) and ``keep DIR [--write FILE]`` (the rule's verdict, printed and written)."""
    ap = argparse.ArgumentParser(description=description)
    sub = ap.add_subparsers(dest="what", required=True)
    la = sub.add_parser("launch", help="the fastest launch in a kernels.json")
    la.add_argument("kernels", type=pathlib.Path)
    la.add_argument("--write", type=pathlib.Path, help=f"{module}, whose launch constants to set")
    ke = sub.add_parser("keep", help="kept or rejected, from with / with-again / without")
    ke.add_argument("folder", type=pathlib.Path)
    ke.add_argument("--write", type=pathlib.Path, help="write kept or rejected here")
    args = ap.parse_args(argv)
    if args.what == "launch":
        launch(json.loads(args.kernels.read_text()), args.write)
        if args.write:
            print(f"written to {args.write}")
        return 0
    r = keep(args.folder)
    verdict = "kept" if r["kept"] else "rejected"
    print(f"with {r['with'][0]:,.0f} / {r['with'][1]:,.0f} tokens/s, without {r['without']:,.0f}: "
          f"gain {r['gain']:+.2%}, drift {r['drift']:.2%}, keep when gain > {r['threshold']:.2%}: {verdict}")
    if args.write:
        args.write.write_text(verdict + "\n")
    return 0


def _launch(kernels: dict, write: pathlib.Path | None) -> None:
    best = fastest(kernels)
    print(f"fastest: {best['programs_per_sm']} program(s) per SM, {best['num_warps']} warps, "
          f"{best['rows_per_iteration']} row(s) per iteration: {best['backward']['median_ms']:.3f} ms")
    if write:
        write_launch(write, best)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], "norm_backward.py", _launch)


if __name__ == "__main__":
    raise SystemExit(main())
