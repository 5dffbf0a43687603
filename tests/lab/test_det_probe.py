"""The divergence probe names the first weight, module output and gradient that differ."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("det_probe", Path(__file__).parents[2] / "benchmarks/scripts/det_probe.py")
det_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(det_probe)


def test_digest_sees_one_bit():
    a = torch.ones(8, dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[3] ^= 1  # the lowest mantissa bit of one element
    assert det_probe._digest(a) == det_probe._digest(a.clone())
    assert det_probe._digest(a) != det_probe._digest(b)


def test_diff_names_the_first_divergent_module():
    base = {"step1_loss": 1.0, "weights": {"w": "0", "v": "1"}, "grads": {"w": "2", "v": "3"},
            "forward": [["embed", "a"], ["layers.0.attn", "b"], ["layers.0.mlp", "c"], ["output", "d"]]}
    other = {**base, "step1_loss": 1.5, "forward": [["embed", "a"], ["layers.0.attn", "b"], ["layers.0.mlp", "X"],
                                                    ["output", "Y"]], "grads": {"w": "2", "v": "Z"}}
    got = det_probe.diff(base, other)
    assert got["weights_differ"] == []
    assert got["first_forward_difference"] == {"index": 2, "module": "layers.0.mlp"}
    assert got["grads_differ"] == ["v"]
    assert det_probe.diff(base, base)["first_forward_difference"] is None
