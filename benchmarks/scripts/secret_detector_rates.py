"""The secret detector's miss rate and false-refusal rate, measured on the labelled set (CPU, ~1 s).

The set is tests/unit/data/secret_labels.yaml (real secrets and real non-secrets, generated in the
providers' formats with random content and written by hand; benchmarks/lab/secret_labels.py expands
it); the detector is muse_stack.util.credentials.findings, the one rule every check of a value uses.
Writes benchmarks/results/secret-detector-rates/rates.json (the figures, in all, by origin and by
kind, with the id of every miss and false refusal) and its result.json; docs/input-validation.md
shows the rates from rates.json (benchmarks/scripts/render.py).

    python benchmarks/scripts/secret_detector_rates.py           # measure and write
    python benchmarks/scripts/secret_detector_rates.py --check   # exit 1 where rates.json differs
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from lab.secret_labels import LABELS, labelled, measure  # noqa: E402

FOLDER = REPO / "benchmarks" / "results" / "secret-detector-rates"
COMMAND = "python benchmarks/scripts/secret_detector_rates.py"


def rates() -> dict:
    """What the detector does on the set now, as rates.json holds it."""
    items, accepted = labelled()
    out = measure(items)
    return {"labels": LABELS.relative_to(REPO).as_posix(),
            "labels_sha256": hashlib.sha256(LABELS.read_bytes()).hexdigest(),
            "detector": "muse_stack/util/credentials.py (findings)",
            **out,
            "accepted_misses": accepted["misses"], "accepted_false_refusals": accepted["false_refusals"]}


def header(r: dict) -> dict:
    return {
        "schema": "muse-stack-benchmark-result/1",
        "id": FOLDER.name,
        "claim": (f"On {r['secrets']} labelled secrets and {r['not_secrets']} labelled non-secrets the secret "
                  "detector misses and falsely refuses the fractions rates.json records."),
        "status": "current",
        "date": dt.date.today().isoformat(),
        "hardware": "CPU: any machine (the detector's verdicts do not depend on it)",
        "fingerprint": "not recorded",
        "commands": [COMMAND],
        "method": "not applicable",
        "measured": [
            {"name": "miss_rate", "unit": "fraction of labelled secrets the detector passes",
             "source": "rates.json#/miss_rate"},
            {"name": "false_refusal_rate", "unit": "fraction of labelled non-secrets the detector refuses",
             "source": "rates.json#/false_refusal_rate"},
        ],
        "figures": {"rates.json": "the rates in all, by origin (generated, hand-written) and by kind, with the id of "
                                  "every miss and false refusal and the labelled set's sha256"},
        "runs": {},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed rates.json")
    args = parser.parse_args(argv)
    r = rates()
    text = json.dumps(r, indent=2) + "\n"
    if args.check:
        committed = (FOLDER / "rates.json").read_text() if (FOLDER / "rates.json").is_file() else ""
        if committed != text:
            print(f"{FOLDER / 'rates.json'} is not what the detector does now: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    FOLDER.mkdir(parents=True, exist_ok=True)
    (FOLDER / "rates.json").write_text(text)
    (FOLDER / "result.json").write_text(json.dumps(header(r), indent=2) + "\n")
    print(f"miss rate {r['miss_rate']:.4%} ({r['misses']} of {r['secrets']} secrets), false-refusal rate "
          f"{r['false_refusal_rate']:.4%} ({r['false_refusals']} of {r['not_secrets']} non-secrets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
