"""GPUs as the NVIDIA driver reports them through NVML (nvidia-ml-py)."""

from __future__ import annotations

import ctypes
import uuid
from typing import Any

from muse_stack.fingerprint.absent import absent


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cuda_version_text(encoded: int) -> str:
    """NVML and the CUDA runtime encode CUDA versions as major*1000 + minor*10."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def _probe(pynvml: Any, what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        return absent(f"{what}: {exc}")


def _fabric(pynvml: Any, handle: Any) -> Any:
    """GPU fabric (multi-node NVLink, GB200 NVL72) identity; trusted only when NVML marks it valid."""
    getter = getattr(pynvml, "nvmlDeviceGetGpuFabricInfoV", None)
    struct = getattr(pynvml, "c_nvmlGpuFabricInfoV_t", None)
    if getter is None or struct is None:
        getter = getattr(pynvml, "nvmlDeviceGetGpuFabricInfo", None)
        struct = getattr(pynvml, "c_nvmlGpuFabricInfo_t", None)
    if getter is None or struct is None:
        return absent("this nvidia-ml-py has no GPU fabric query")
    info = struct()
    try:
        getter(handle, ctypes.byref(info))
    except pynvml.NVMLError as exc:
        return absent(f"nvmlDeviceGetGpuFabricInfo: {exc}")
    completed = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    if info.state == getattr(pynvml, "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", 0):
        return absent("GPU fabric not supported on this GPU (no multi-node NVLink)")
    if info.state != completed:
        return absent(f"GPU fabric registration not complete (state {info.state}); cluster id and clique not valid")
    if info.status != pynvml.NVML_SUCCESS:
        return absent(f"GPU fabric registration finished with status {info.status}; cluster id and clique not valid")
    raw = bytes(bytearray(info.clusterUuid))
    return {
        "cluster_uuid": str(uuid.UUID(bytes=raw))
        if any(raw)
        else absent("NVML reports an all-zero cluster UUID: not part of a multi-node NVLink domain"),
        "clique_id": int(info.cliqueId),
    }


def _nvlink(pynvml: Any, handle: Any) -> Any:
    active = 0
    supported = False
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError:
            continue
        supported = True
        active += int(state == getattr(pynvml, "NVML_FEATURE_ENABLED", 1))
    if not supported:
        return absent("NVML reports no NVLink on this GPU")
    return {"active_links": active}


def _device(pynvml: Any, index: int) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    cc = _probe(pynvml, "compute capability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    mem = _probe(pynvml, "memory info", pynvml.nvmlDeviceGetMemoryInfo, handle)
    pci = _probe(pynvml, "PCI info", pynvml.nvmlDeviceGetPciInfo, handle)
    power = _probe(pynvml, "power limit", pynvml.nvmlDeviceGetPowerManagementLimit, handle)
    sm_clock = _probe(pynvml, "max SM clock", pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM)
    mem_clock = _probe(pynvml, "max memory clock", pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM)
    mig = _probe(pynvml, "MIG mode", pynvml.nvmlDeviceGetMigMode, handle)
    return {
        "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "uuid": _probe(pynvml, "UUID", lambda h: _text(pynvml.nvmlDeviceGetUUID(h)), handle),
        "pci_bus_id": pci if isinstance(pci, dict) else _text(pci.busId),
        "compute_capability": cc if isinstance(cc, dict) else f"{cc[0]}.{cc[1]}",
        "memory_total_bytes": mem if isinstance(mem, dict) else int(mem.total),
        "power_limit_w": power if isinstance(power, dict) else round(power / 1000.0, 1),
        "max_sm_clock_mhz": sm_clock,
        "max_memory_clock_mhz": mem_clock,
        "mig_mode": mig if isinstance(mig, dict) else ("enabled" if mig[0] else "disabled"),
        "vbios": _probe(pynvml, "VBIOS version", lambda h: _text(pynvml.nvmlDeviceGetVbiosVersion(h)), handle),
        "nvlink": _nvlink(pynvml, handle),
        "fabric": _fabric(pynvml, handle),
    }


def collect() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError as exc:
        return absent(f"nvidia-ml-py (pynvml) not installed: {exc}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return absent(f"no NVIDIA driver: NVML init failed: {exc}")
    try:
        driver = _probe(pynvml, "driver version", lambda: _text(pynvml.nvmlSystemGetDriverVersion()))
        cuda_drv = _probe(pynvml, "CUDA driver version", pynvml.nvmlSystemGetCudaDriverVersion_v2)
        count = pynvml.nvmlDeviceGetCount()
        devices = {str(i): _device(pynvml, i) for i in range(count)}
        names = sorted({d["name"] for d in devices.values()})
        capabilities = sorted({d["compute_capability"] for d in devices.values() if isinstance(d["compute_capability"], str)})
        return {
            "count": count,
            "names": names,
            "compute_capabilities": capabilities,
            "driver_version": driver,
            "cuda_driver_version": cuda_drv if isinstance(cuda_drv, dict) else cuda_version_text(cuda_drv),
            "nvml_version": _probe(pynvml, "NVML version", lambda: _text(pynvml.nvmlSystemGetNVMLVersion())),
            "devices": devices,
        }
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
