"""The towers' parity bound's premises on this CPU (lab.verify.towers_bound.measure and, under ``trained``,
measure_training), written as JSON (CPU).

    python benchmarks/scripts/towers_cpu_bound.py --out benchmarks/results/towers-parity-pinned-routing/cpu-routing.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the lab package

from lab.verify.towers_bound import measure, measure_training  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
              **measure(), "trained": measure_training()}
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
