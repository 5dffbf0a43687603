"""Whether the megatron-core engine can run here, with the reason when it cannot."""

from __future__ import annotations

from muse_stack.util.errors import EngineUnavailable


def missing() -> str | None:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine (megatron-core and Transformer Engine run on NVIDIA GPUs)"
    for module in ("megatron.core", "transformer_engine.pytorch"):
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
            return f"{module} is not importable ({type(exc).__name__}: {exc})"
    return None


def require_megatron() -> None:
    reason = missing()
    if reason:
        raise EngineUnavailable(
            f"this recipe needs the megatron-core engine: {reason}", field="engine", value="megatron",
            fix="run it in a GPU image built by `make image gpu=h200|b200|gb200` (docker run ... muse-stack run NAME), "
                "or try the CPU reference engine with `muse-stack run tiny-cpu`")
