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


def test_bridge_gets_the_engine_optimizer_mapping_precision_aware_included():
    """Bridge's optimizer is built from the engine's own mapping of the recipe, so a setting the runner uses (the
    precision-aware optimizer) cannot be left out; a field Bridge's class lacks is reported, not passed."""
    import dataclasses

    from muse_stack.engines.mcore.config import optimizer_config_kwargs
    from muse_stack.recipes.catalogue import load_recipe

    recipe = load_recipe("slice-1gpu")
    mapped = optimizer_config_kwargs(recipe)
    assert mapped["use_precision_aware_optimizer"] is True  # the slice states optimizer.precision_aware: true
    missing = sorted(mapped)[0]
    # a class with every mapped field but one, as a Bridge release without that field would be
    fields = [(name, object, None) for name in sorted(mapped) if name != missing]
    bridge_like = dataclasses.make_dataclass("OptimizerConfig", fields)
    kwargs, dropped = bridge_slice.engine_optimizer_kwargs(recipe, bridge_like)
    assert dropped == [missing] and missing not in kwargs
    assert {k: v for k, v in mapped.items() if k != missing} == kwargs
