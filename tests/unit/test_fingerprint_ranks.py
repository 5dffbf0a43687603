"""Merging the fingerprints of every rank: agreement, per-rank fields, differing paths."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from muse_stack.fingerprint import merge_ranks

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/fingerprints/crafted-b200-attune.json"


def rank_doc(rank: int, node: int) -> dict:
    doc = json.loads(FIXTURE.read_text())
    doc["process"].update({"rank": rank, "local_rank": rank % 8, "node_rank": node, "pid": 1000 + rank,
                           "hostname": f"node-{node}"})
    doc["host"]["hostname"] = f"node-{node}"
    doc["capture"]["captured_at"] = f"2026-10-17T09:00:{rank:02d}+00:00"
    doc["cuda_libraries"]["initialised"][0] = f"set device {rank % 8} from LOCAL_RANK"
    for i, dev in doc["gpu"]["devices"].items():
        dev["uuid"] = f"GPU-node{node}-{i}"
    doc["environment"]["variables"]["CUDA_VISIBLE_DEVICES"] = str(rank % 8)
    return doc


def test_ranks_that_differ_only_in_per_rank_fields_agree():
    docs = [rank_doc(r, r // 8) for r in range(16)]
    merged = merge_ranks(list(reversed(docs)))
    assert merged["ranks"]["count"] == 16
    assert merged["ranks"]["agree"] is True
    assert merged["ranks"]["differing"] == []
    assert merged["process"]["rank"] == 0  # rank 0's document, whatever the input order
    assert merged["ranks"]["ranks"] == list(range(16))


def test_differing_fields_are_listed_with_each_rank_value():
    docs = [rank_doc(r, r // 8) for r in range(16)]
    docs[9]["cuda_libraries"]["nccl"]["version"] = "2.29.1"
    docs[12]["frameworks"]["transformer_engine"]["core_library"]["sha256"] = "f" * 64
    del docs[3]["environment"]["variables"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"]
    merged = merge_ranks(docs)
    r = merged["ranks"]
    assert r["agree"] is False
    assert r["differing"] == [
        "cuda_libraries.nccl.version",
        "environment.variables.NVTE_ALLOW_NONDETERMINISTIC_ALGO",
        "frameworks.transformer_engine.core_library.sha256",
    ]
    assert r["values"]["cuda_libraries.nccl.version"] == {"0": "2.30.7", "9": "2.29.1"}
    assert r["values"]["environment.variables.NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == {"0": "1", "3": "—"}


def test_merge_leaves_inputs_untouched_and_single_rank_agrees():
    doc = rank_doc(0, 0)
    before = copy.deepcopy(doc)
    merged = merge_ranks([doc])
    assert doc == before
    assert merged["ranks"] == {**merged["ranks"], "count": 1, "agree": True, "differing": []}
    with pytest.raises(ValueError):
        merge_ranks([])
