"""benchmarks/scripts/bridge_slice.py on a machine without Megatron-Bridge: a clear refusal, and the FLOPs
of the model Bridge runs (CPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bridge_slice", ROOT / "benchmarks" / "scripts" / "bridge_slice.py")
bridge_slice = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bridge_slice)


def test_without_bridge_the_script_says_how_to_install_it():
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge") is not None:
        import pytest

        pytest.skip("Megatron-Bridge is installed here")
    done = subprocess.run([sys.executable, "benchmarks/scripts/bridge_slice.py", "slice-1gpu", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    assert "Megatron-Bridge is not importable" in done.stderr and "benchmarks/scripts/bridge/stage.sh install" in done.stderr


def test_the_bridge_model_flops_differ_only_by_what_it_leaves_out():
    from muse_stack.models.muse_spark.flops import training_flops_per_token
    from muse_stack.recipes.catalogue import load_recipe

    cfg = load_recipe("slice-1gpu").model_config_resolved()
    muse = training_flops_per_token(cfg, [4096])
    assert bridge_slice.bridge_model_flops(cfg, [4096], output_gate=True) == muse
    no_gate = bridge_slice.bridge_model_flops(cfg, [4096], output_gate=False)
    gate = 2 * cfg.num_hidden_layers * cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim
    assert muse["training"] - no_gate["training"] == 3 * gate  # forward + both backward GEMMs of the gate
