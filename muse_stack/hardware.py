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


GPUS: dict[str, GpuSpec] = {
    "H200": GpuSpec(
        name="H200", memory_gib=143771 / 1024, memory_source="nvidia-smi on an H200 SXM: 143771 MiB",
        peak_bf16_tflops=989.0, peak_source="NVIDIA H100/H200 SXM datasheet, dense BF16",
        arch="sm90", per_node_default=8),
    "H100": GpuSpec(
        name="H100", memory_gib=81559 / 1024, memory_source="nvidia-smi on an H100 SXM 80GB: 81559 MiB",
        peak_bf16_tflops=989.0, peak_source="NVIDIA H100 SXM datasheet, dense BF16",
        arch="sm90", per_node_default=8),
    "B200": GpuSpec(
        name="B200", memory_gib=178.35, memory_source="the B200 OpenRecipes record: 178.35 GiB per GPU",
        peak_bf16_tflops=2250.0, peak_source="the B200 OpenRecipes record's MFU check: 2.25e15 dense BF16",
        arch="sm100", per_node_default=8),
    "GB200": GpuSpec(
        name="GB200", memory_gib=186e9 / 2**30, memory_source="NVIDIA GB200 NVL72 datasheet: 186 GB HBM3e per GPU",
        peak_bf16_tflops=2500.0, peak_source="NVIDIA GB200 NVL72 datasheet: 180 PFLOP/s dense BF16 per 72 GPUs",
        arch="sm100", per_node_default=4),
}


def gpu_spec(gpu: str) -> GpuSpec | None:
    """The GPU's facts, or None for ``cpu`` (its peak is measured at run time)."""
    return GPUS.get(gpu)
