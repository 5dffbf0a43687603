"""A run's fingerprint in the words of a recorded stack (an OpenRecipes record's ``stack``)."""

from __future__ import annotations

from typing import Any

from muse_stack.compare.audit import lookup

_PATHS: dict[str, tuple[str, ...]] = {
    "megatron_lm": ("frameworks", "megatron_core", "version"),
    "transformer_engine": ("frameworks", "transformer_engine", "version"),
    "pytorch": ("frameworks", "torch", "version"),
    "cuda": ("cuda_libraries", "cuda_runtime", "version"),
    "nccl": ("cuda_libraries", "nccl", "version"),
    "cudnn": ("cuda_libraries", "cudnn", "version"),
    "flash_attn": ("frameworks", "flash_attn", "version"),
    "deepep": ("frameworks", "deepep", "version"),
    "python": ("python", "version"),
}


def summarise(fp: dict[str, Any]) -> dict[str, Any]:
    """Each component as the run loaded it; None where the fingerprint records it absent."""
    out: dict[str, Any] = {"framework": "muse-stack " + str(lookup(fp, ("identity", "muse_stack_version"))[0])}
    for key, path in _PATHS.items():
        value, _why = lookup(fp, path)
        if key == "megatron_lm" and value is not None:
            value = f"megatron-core {value}"
        if key == "pytorch" and value is not None:
            cuda, _ = lookup(fp, ("frameworks", "torch", "cuda_build"))
            value = f"{value} (CUDA {cuda} build)" if cuda else f"{value} (CPU build)"
        out[key] = None if value is None else str(value)
    gpus, _ = lookup(fp, ("gpu", "count"))
    efa, _ = lookup(fp, ("network", "efa", "installer_version"))
    ofi, _ = lookup(fp, ("network", "aws_ofi_nccl", "version"))
    parts = [f"{gpus} GPUs per node" if gpus else None, f"EFA {efa}" if efa else None,
             f"aws-ofi-nccl {ofi}" if ofi else None]
    out["network"] = ", ".join(p for p in parts if p) or None
    captured, _ = lookup(fp, ("capture", "captured_at"))
    out["source"] = f"muse-stack fingerprint of the measured run, captured {captured}"
    return out
