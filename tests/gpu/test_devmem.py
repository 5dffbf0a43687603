"""The device memory block of results.json: CUDA runs only, allocator and NVML figures."""

from __future__ import annotations

import pytest
import torch

from muse_stack.machine.devmem import cuda_memory


def test_a_cpu_run_has_no_device_memory_block():
    assert cuda_memory("cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reserved_covers_allocated_and_nvml_sees_the_reserve():
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB held by the caching allocator
    got = cuda_memory("cuda:0")
    assert got["max_reserved_gib"] >= got["max_allocated_gib"] >= 64 / 1024
    if got["device_used_gib"] is not None:  # the driver's view includes every reserved segment
        assert got["device_used_gib"] >= torch.cuda.memory_reserved() / 2**30
    del x
