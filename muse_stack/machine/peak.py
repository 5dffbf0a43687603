"""The peak FLOP/s an MFU figure is divided by: the GPU's stated dense bf16 peak, or, on a
CPU, a measured fp32 matrix-multiply rate of this machine (stated as measured)."""

from __future__ import annotations

import time

from muse_stack.machine.hardware import gpu_spec


def measure_cpu_matmul_tflops(n: int = 1024, repeats: int = 5) -> float:
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def peak_for(gpu: str) -> tuple[float | None, str]:
    """Stated GPU peak, or a CPU matmul rate measured with the threads training uses."""
    spec = gpu_spec(gpu)
    if spec is not None:
        return spec.peak_bf16_tflops, spec.peak_source
    import torch

    tflops = measure_cpu_matmul_tflops()
    return tflops, (f"measured on this CPU: fp32 1024x1024 matmul, best of 5 after one warm-up, "
                    f"{torch.get_num_threads()} threads")
