"""The end of every GPU benchmark and parity script (``benchmarks/``, ``engines/mcore/*parity*``): print the summary, write the JSON,
close the process group."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def finish(result: dict[str, Any], out: str | None, *, omit: Callable[[str], bool] = lambda key: False,
           summary: dict[str, Any] | None = None) -> None:
    """Print ``summary`` (default: ``result`` less the keys ``omit`` names, long per-step lists)
    on one line, write ``result`` whole to ``out`` when given, and destroy the process group the
    engine opened."""
    if summary is None:
        summary = {k: v for k, v in result.items() if not omit(k)}
    print(json.dumps(summary, default=str), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
