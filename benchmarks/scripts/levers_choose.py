"""Keep or reject each of issue 34's levers by its measurement (``h200.sh levers5``'s folder).

Each lever's run flips one setting of the shipped ``slice-1gpu`` recipe; the shipped recipe runs
first and last in the same call (``shipped.json``, ``shipped-again.json``). The baseline is their
mean, and their relative difference is the drift of the machine over the call. A lever is kept
when its tokens/s beats the baseline by more than twice that drift and by at least 0.5% (below
that, a step-time change is within what repeated runs of one setting showed in
``benchmarks/results/side-by-side/2026-12-02/``: 49,125 / 49,125 / 48,887 tokens/s, 0.5% apart).

    python3 benchmarks/scripts/levers_choose.py DIR [--write FILE]
    python3 benchmarks/scripts/levers_choose.py --list

prints a table and, with ``--write``, the kept settings as recipe overrides (one line, space
separated), which is what ``benchmarks/results/side-by-side/run.sh`` takes as RUNNER_OVERRIDES.
``--list`` prints each lever's file name and override, one a line: the runs ``h200.sh levers5``
makes, so the levers are named in this one place.
"""

from __future__ import annotations

import argparse
import json
import pathlib

#: file name -> the recipe override the run used (the flip of what shipped)
LEVERS = {
    "no-wgrad-accumulation-fusion": "fusions.gradient_accumulation=false",
    "clip-host-sync": "performance.clip_on_device=false",
    "optimizer-cuda-graph": "performance.optimizer_cuda_graph=true",
    "router-fusion": "fusions.router=true",
    "no-permute-fusion": "fusions.permute=false",
    "overlap-grad-reduce": "performance.overlap_grad_reduce=true",
}
MIN_GAIN = 0.005


def baseline(first: float, again: float) -> tuple[float, float, float]:
    """(baseline, drift, threshold) of the rule above from the two runs of the reference setting: their
    mean, their relative difference, and the gain a change must beat (twice the drift, at least MIN_GAIN)."""
    base = (first + again) / 2
    drift = abs(first - again) / base
    return base, drift, max(2 * drift, MIN_GAIN)


def runs_tps(folder: pathlib.Path, names: tuple[str, ...]) -> dict[str, float]:
    """Each named ``engine_steps.py`` run's tokens/s per GPU in ``folder`` (``NAME.json``); every one is needed."""
    missing = [n for n in names if not (folder / f"{n}.json").exists()]
    if missing:
        raise SystemExit(f"{folder}: {missing[0]}.json is missing ({', '.join(names)} are all needed)")
    return {n: json.loads((folder / f"{n}.json").read_text())["tokens_per_s_per_gpu"] for n in names}


def choose(folder: pathlib.Path) -> tuple[list[dict], list[str], float]:
    def tps(name: str) -> float | None:
        p = folder / f"{name}.json"
        return json.loads(p.read_text())["tokens_per_s_per_gpu"] if p.exists() else None

    a, b = tps("shipped"), tps("shipped-again")
    if a is None or b is None:
        raise SystemExit(f"{folder}: shipped.json and shipped-again.json are both needed (the baseline and its drift)")
    base, _, threshold = baseline(a, b)
    rows, kept = [], []
    for name, override in LEVERS.items():
        t = tps(name)
        gain = None if t is None else t / base - 1
        keep = gain is not None and gain > threshold
        rows.append({"lever": name, "override": override, "tokens_per_s": t, "gain": gain, "kept": keep})
        if keep:
            kept.append(override)
    return rows, kept, threshold


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path, nargs="?")
    ap.add_argument("--write", type=pathlib.Path, help="write the kept overrides here (one line)")
    ap.add_argument("--list", action="store_true", help="print each lever's file name and override, and stop")
    args = ap.parse_args(argv)
    if args.list:
        for name, override in LEVERS.items():
            print(name, override)
        return 0
    if args.folder is None:
        ap.error("a levers5 folder is needed (or --list)")
    rows, kept, threshold = choose(args.folder)
    print(f"keep when gain > {threshold:.2%}")
    for r in rows:
        g = "failed" if r["gain"] is None else f"{r['gain']:+.2%}"
        print(f"  {r['lever']:30s} {r['override']:40s} {g:>8s}  {'kept' if r['kept'] else 'rejected'}")
    print("kept:", " ".join(kept) or "(none)")
    if args.write:
        args.write.write_text(" ".join(kept) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
