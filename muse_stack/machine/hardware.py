"""GPU facts the planner and the MFU figures use, each with its source."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class GpuSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_gib: float
    memory_source: str
    peak_bf16_tflops: float | None
    peak_source: str
    arch: str | None
    per_node_default: int
    # The step-time model's hardware (muse_stack/plan/cost.py): bandwidths per direction, per GPU.
    hbm_gbps: float | None = None  # HBM bandwidth, GB/s
    hbm_source: str = ""
    nvlink_gbps: float | None = None  # NVLink, GB/s per direction per GPU
    nvlink_domain: int | None = None  # GPUs one NVLink domain joins
    nvlink_source: str = ""
    scaleout_gbps: float | None = None  # scale-out network (EFA or InfiniBand), GB/s per direction per GPU
    scaleout_source: str = ""


GPUS: dict[str, GpuSpec] = {
    "H200": GpuSpec(
        name="H200", memory_gib=143771 / 1024, memory_source="nvidia-smi on an H200 SXM: 143771 MiB",
        peak_bf16_tflops=989.0, peak_source="NVIDIA H100/H200 SXM datasheet, dense BF16",
        arch="sm90", per_node_default=8,
        hbm_gbps=4800.0, hbm_source="NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
        nvlink_gbps=450.0, nvlink_domain=8,
        nvlink_source="NVIDIA H200 datasheet: NVLink 900 GB/s per GPU (both directions); HGX H200: 8 GPUs",
        scaleout_gbps=50.0,
        scaleout_source="NVIDIA HGX H200 reference: one 400 Gb/s ConnectX-7 InfiniBand NDR port per GPU"),
    "H100": GpuSpec(
        name="H100", memory_gib=81559 / 1024, memory_source="nvidia-smi on an H100 SXM 80GB: 81559 MiB",
        peak_bf16_tflops=989.0, peak_source="NVIDIA H100 SXM datasheet, dense BF16",
        arch="sm90", per_node_default=8,
        hbm_gbps=3350.0, hbm_source="NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3",
        nvlink_gbps=450.0, nvlink_domain=8, nvlink_source="NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both directions); HGX: 8",
        scaleout_gbps=50.0, scaleout_source="NVIDIA HGX H100 reference: one 400 Gb/s ConnectX-7 port per GPU"),
    "B200": GpuSpec(
        name="B200", memory_gib=178.35, memory_source="the B200 OpenRecipes record: 178.35 GiB per GPU",
        peak_bf16_tflops=2250.0,
        peak_source="NVIDIA HGX B200 datasheet: 36 PFLOPS BF16 with sparsity per 8 GPUs (2.25 PFLOPS dense per GPU)",
        arch="sm100", per_node_default=8,
        hbm_gbps=8000.0, hbm_source="NVIDIA HGX B200 datasheet: 64 TB/s HBM3e per 8 GPUs",
        nvlink_gbps=900.0, nvlink_domain=8,
        nvlink_source="NVIDIA HGX B200 datasheet: NVLink 5, 1.8 TB/s per GPU (both directions), 8 GPUs",
        scaleout_gbps=50.0,
        scaleout_source="AWS p6-b200.48xlarge: 3,200 Gb/s EFAv4 per instance of 8 GPUs (400 Gb/s per GPU)"),
    "GB200": GpuSpec(
        name="GB200", memory_gib=186e9 / 2**30, memory_source="NVIDIA GB200 NVL72 datasheet: 186 GB HBM3e per GPU",
        peak_bf16_tflops=2500.0, peak_source="NVIDIA GB200 NVL72 datasheet: 180 PFLOP/s dense BF16 per 72 GPUs",
        arch="sm100", per_node_default=4,
        hbm_gbps=8000.0, hbm_source="NVIDIA GB200 NVL72 datasheet: 576 TB/s HBM3e per 72 GPUs",
        nvlink_gbps=900.0, nvlink_domain=72,
        nvlink_source="NVIDIA GB200 NVL72 datasheet: NVLink 5, 130 TB/s per 72 GPUs (1.8 TB/s per GPU, both directions)",
        scaleout_gbps=50.0,
        scaleout_source="NVIDIA GB200 NVL72 reference architecture: one 400 Gb/s ConnectX-7 InfiniBand port per GPU"),
}


def gpu_spec(gpu: str) -> GpuSpec | None:
    """The GPU's facts, or None for ``cpu`` (its peak is measured at run time)."""
    return GPUS.get(gpu)
