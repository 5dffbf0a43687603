"""The host time of an ungraphed MoE layer's forward and backward, from the measured probe (CPU only).

    python benchmarks/scripts/plan/fit_host.py [--write]

benchmarks/results/host-sync-probe/ holds ``host_sync_probe.py``'s measurements on one GPU machine: one megatron-core
MoE layer (alltoall dispatcher, no CUDA graphs) with the per-GPU shapes of the published models, in bf16 and in FP8
current scaling, its forward and its backward timed at token counts from 128 up. At 128 tokens the GPU work is a
small part of the time, so those walls are the host's (``host_fwd_s``, ``host_bwd_s`` of each probe). The host's
work grows with the layer's local experts (the grouped GEMMs' per-expert splits, FP8's per-expert casts), so per
precision and pass this fits ``host = a + b x local experts`` by least squares over every probe of that precision
(the models at EP 8 and Qwen3-30B-A3B at EP 2 and 32: 4 to 64 local experts) and prints each probe's residual.
``--write`` writes the eight numbers, to ``DIGITS`` significant digits, into the planner's calibration (``scale``
in ``muse_stack/plan/calibration.json``) with that folder and this command; muse_stack/plan/scale.py prices a MoE
layer of a run without CUDA graphs at ``max(GPU, host)`` in each pass with them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import datafiles  # noqa: E402

RESULT = Path(__file__).resolve().parents[2] / "results" / "host-sync-probe"
FILES = ("host_sync.json", "host_sync_ep.json")
#: significant digits kept in the calibration (a rounding of at most 0.5%, far below the probes' scatter)
DIGITS = 3
#: the probe's precisions and the calibration's names for them
PRECISIONS = {"bf16": "bf16", "fp8-cs": "fp8"}


def points(folder: Path = RESULT) -> dict[str, list[dict]]:
    """Per precision, each probe's local experts and host floors."""
    out: dict[str, list[dict]] = {p: [] for p in PRECISIONS}
    for name in FILES:
        for probe in json.loads((folder / name).read_text())["probes"]:
            out[probe["precision"]].append({"model": probe["shape"]["model"], "ep": probe["shape"]["ep"],
                                            "experts": probe["shape"]["experts"], "fwd": probe["host_fwd_s"],
                                            "bwd": probe["host_bwd_s"]})
    return out


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise SystemExit("the probes need at least two local-expert counts to fit a line")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def fit(folder: Path = RESULT) -> dict:
    out: dict = {}
    for precision, rows in points(folder).items():
        xs = [float(r["experts"]) for r in rows]
        for phase in ("fwd", "bwd"):
            a, b = line(xs, [r[phase] for r in rows])
            key = f"ungraphed_host_{phase}_{PRECISIONS[precision]}"
            out[f"{key}_s"] = a
            out[f"{key}_per_expert_s"] = b
            out.setdefault("residuals_s", {})[key] = {f"{r['model']} ep{r['ep']}": a + b * r["experts"] - r[phase]
                                                      for r in rows}
    return out


def write_calibration(out: dict, path: Path = datafiles.CALIBRATION) -> str:
    cmd = datafiles.command(__file__, "--write")
    entries = {k: datafiles.entry(datafiles.significant(v, DIGITS), RESULT, cmd)
               for k, v in out.items() if k != "residuals_s"}
    return datafiles.write_calibration({"scale": entries}, path)


def show(out: dict) -> None:
    for k, v in out.items():
        if k != "residuals_s":
            print(f"{k}: {v * 1e3:.4f} ms")
    for k, res in out["residuals_s"].items():
        print(f"{k} residuals (ms): " + ", ".join(f"{n} {r * 1e3:+.2f}" for n, r in res.items()))


def main(argv: list[str] | None = None) -> int:
    return datafiles.fit_cli(argv, "the fit", fit, show, write_calibration)


if __name__ == "__main__":
    raise SystemExit(main())
