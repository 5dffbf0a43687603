"""The engine's Triton Adam step (``muse_stack/engines/mcore/adam_step.py``): its launch, chosen from
``kernels.py``'s timings, and whether the engine runs it, chosen from the step (``h200.sh adam``).

    python3 benchmarks/scripts/adam_choose.py launch KERNELS.json [--write muse_stack/engines/mcore/adam_step.py]
    python3 benchmarks/scripts/adam_choose.py keep DIR [--write FILE]

``launch`` takes the fastest of the launches ``kernels.py --only adam`` timed (TE's FusedAdam over one MoE
layer's experts stepped by the Triton step, median of 5 calls) and with ``--write`` sets the module's
``PROGRAMS_PER_SM``, ``NUM_WARPS`` and ``BLOCK`` to it.

``keep`` reads ``with.json`` and ``with-again.json`` (``engine_steps.py`` as shipped, the Triton step on, first
and last in one call) and ``without.json`` (``--te-adam``: TE's multi_tensor_adam), and applies
:mod:`levers_choose`'s rule as ``normbwd_choose.py keep`` does. ``--write`` writes ``kept`` or ``rejected``.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from normbwd_choose import cli, write_constants  # noqa: E402

LAUNCHES_KEY = "one Triton launch, launches"


def fastest(kernels: dict) -> dict:
    """The launch with the least median time (the first of equals, in the order kernels.py timed them)."""
    launches = kernels.get("adam", {}).get(LAUNCHES_KEY)
    if not launches:
        raise SystemExit(f"no launches under adam[{LAUNCHES_KEY!r}]: run kernels.py --only adam")
    return min(launches, key=lambda r: r["step"]["median_ms"])


def _launch(kernels: dict, write: pathlib.Path | None) -> None:
    best = fastest(kernels)
    te = min(v["median_ms"] for k, v in kernels["adam"].items() if k.startswith("chunk "))
    print(f"fastest: {best['programs_per_sm']} program(s) per SM, {best['num_warps']} warps, "
          f"{best['block']} elements per iteration: {best['step']['median_ms']:.3f} ms "
          f"({best['step']['gb_per_s']:,.0f} GB/s); TE's fastest chunk: {te:.3f} ms")
    if write:
        write_constants(write, {"PROGRAMS_PER_SM": best["programs_per_sm"], "NUM_WARPS": best["num_warps"],
                                "BLOCK": best["block"]})


def main(argv: list[str] | None = None) -> int:
    return cli(argv, __doc__.splitlines()[0], "adam_step.py", _launch)


if __name__ == "__main__":
    raise SystemExit(main())
