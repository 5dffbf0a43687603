"""What a run held on its GPU, as the allocator and as ``nvidia-smi`` see it.

``max_allocated_gib`` is what tensors used at the peak (``torch.cuda.max_memory_allocated``,
the figure the planner's memory model is calibrated to). ``max_reserved_gib`` is what the
caching allocator held from the driver at its peak (``torch.cuda.max_memory_reserved``): the
difference is the allocator's reserve and fragmentation. ``device_used_gib`` is the device's
used memory read through NVML when the run ends (the allocator does not return its segments
before then, so it includes the reserve, plus the CUDA context, the cuBLAS/cuDNN workspaces and
NCCL's buffers, and any other process on the GPU: ``device_processes`` counts them).
"""

from __future__ import annotations

from typing import Any

GIB = 2**30


def cuda_memory(device: str) -> dict[str, Any] | None:
    """The three figures for a CUDA device (None on a CPU run)."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    dev = torch.device(device)
    out: dict[str, Any] = {
        "max_allocated_gib": torch.cuda.max_memory_allocated(dev) / GIB,
        "max_reserved_gib": torch.cuda.max_memory_reserved(dev) / GIB,
    }
    out["reserve_over_allocated"] = (out["max_reserved_gib"] / out["max_allocated_gib"] - 1.0
                                     if out["max_allocated_gib"] else None)
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            # by UUID: NVML numbers every GPU of the host, CUDA only the visible ones
            uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out["device_used_gib"] = info.used / GIB
            out["device_total_gib"] = info.total / GIB
            out["device_processes"] = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML absent or refused: say why, keep the allocator's figures
        out["device_used_gib"] = None
        out["device_used_note"] = f"NVML: {exc}"
    return out
