"""Agreement of the fingerprints captured by every rank of one run.

Some fields differ between ranks by construction and are left out of the comparison:
the capture time, the process (pid, rank numbers), the host name and cgroup, the Slurm
per-task ids, the GPUs' UUIDs and PCI addresses (each node has its own devices), the
per-rank device visibility variables, and what CUDA initialisation did on the rank.
Everything else must be equal on every rank; where it is not, the merged document lists
the field paths and each rank's value. GPU fabric cluster ids and cliques are *not*
ignored: ranks spread over several NVLink domains is a fact worth seeing.
"""

from __future__ import annotations

import copy
from typing import Any

from muse_stack.fingerprint.tree import MISSING, changes, dotted, summarize

PER_RANK_FIELDS: tuple[str, ...] = (
    "capture",
    "process",
    "ranks",
    "host.hostname",
    "host.container.cgroup",
    "host.scheduler.slurm.SLURM_PROCID",
    "host.scheduler.slurm.SLURM_LOCALID",
    "host.scheduler.slurm.SLURM_NODEID",
    "host.scheduler.slurm.SLURMD_NODENAME",
    "gpu.devices.*.uuid",
    "gpu.devices.*.pci_bus_id",
    "cuda_libraries.initialised",
    "environment.variables.CUDA_VISIBLE_DEVICES",
    "environment.variables.NVIDIA_VISIBLE_DEVICES",
    "environment.variables.TORCHELASTIC_*",
    "network.plugin_selection.NCCL_SOCKET_IFNAME",
)
MAX_LISTED_VALUES = 50


def _rank_of(doc: dict[str, Any], position: int) -> int:
    rank = (doc.get("process") or {}).get("rank")
    return rank if isinstance(rank, int) else position


def merge_ranks(fingerprints: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's document with a ``ranks`` section: count, agree, differing field paths,
    and per-rank values of the first differing fields."""
    if not fingerprints:
        raise ValueError("merge_ranks needs at least one fingerprint")
    ordered = sorted(enumerate(fingerprints), key=lambda item: _rank_of(item[1], item[0]))
    ranks = [_rank_of(doc, pos) for pos, doc in ordered]
    docs = [doc for _, doc in ordered]
    reference = docs[0]
    differing: dict[str, dict[str, str]] = {}
    for rank, doc in zip(ranks[1:], docs[1:]):
        for change in changes(reference, doc, skip=PER_RANK_FIELDS):
            key = dotted(change.path)
            values = differing.setdefault(key, {str(ranks[0]): summarize(change.a)})
            values[str(rank)] = summarize(change.b if change.b is not MISSING else MISSING)
    merged = copy.deepcopy(reference)
    paths = sorted(differing)
    merged["ranks"] = {
        "count": len(docs),
        "ranks": ranks,
        "agree": not paths,
        "differing": paths,
        "values": {p: differing[p] for p in paths[:MAX_LISTED_VALUES]},
        "ignored_per_rank": list(PER_RANK_FIELDS),
    }
    return merged
