"""The end of every GPU benchmark script in ``benchmarks/``: print the summary, write the JSON,
close the process group."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def finish(result: dict[str, Any], out: str | None, *, omit: Callable[[str], bool] = lambda key: False) -> None:
    """Print ``result`` less the keys ``omit`` names (long per-step lists) on one line, write it
    whole to ``out`` when given, and destroy the process group the engine opened."""
    print(json.dumps({k: v for k, v in result.items() if not omit(k)}, default=str), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
