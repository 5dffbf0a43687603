"""Memory as ``nvidia-smi`` sees it: the allocated estimate plus what sits outside the allocator.

    used = allocated x (1 + allocator reserve) + outside the allocator + NCCL buffers

The allocator reserve and what a process holds outside the caching allocator (the CUDA
context, loaded kernels, cuBLAS/cuDNN/TE workspaces) are measured on the H200 runs of
benchmarks/ (``benchmarks/scripts/plan/fit_used.py``, output ``fit_used.json``).

NCCL buffers follow NCCL's defaults: every ring or tree collective communicator keeps, per
channel, a receive buffer for each protocol (NCCL's defaults: Simple 4 MiB = NCCL_BUFFSIZE,
LL128 120 x 640 x 8 x 8 B = 4.6875 MiB, LL 8 x 512 x 8 x 16 B = 0.5 MiB) from each of its two ring neighbours; a point-to-point or all-to-all communicator
keeps a Simple buffer per peer and per peer channel. Channel counts are NCCL's defaults for
the link: 16 ring channels over NVLink or the network, 2 channels per point-to-point peer
(NCCL_NCHANNELS_PER_NET_PEER; NVLink peers get the same here).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from muse_stack.plan.calibration import calibrated

MIB = 2**20
GIB = 2**30


class UsedCalibration(BaseModel):
    model_config = ConfigDict(frozen=True)

    # Measured (benchmarks/scripts/plan/fit_used.py, muse_stack/plan/calibration.json's ``used``):
    # max_memory_reserved / max_memory_allocated - 1, the mean over the default-numerics full-training
    # runs on one H200 (the deterministic mode and adapter runs reach more)
    allocator_reserve_fraction: float = calibrated("used", "allocator_reserve_fraction")
    allocator_reserve_source: str = ("measured: max reserved over max allocated, mean of 2 default-numerics H200 "
                                     "training runs (benchmarks/results/plan/fit_used.json)")
    # Measured the same way: NVML's used memory at the end of a run minus the allocator's peak
    # reservation, one process on the GPU (no NCCL peers): the CUDA context, the loaded kernels and
    # the library workspaces. The median over the runs, which spread little whatever the workload
    # (fit_used.json's outside_allocator_range_gib).
    outside_allocator_gib: float = calibrated("used", "outside_allocator_gib")
    ring_channels: int = 16
    p2p_channels_per_peer: int = 2
    simple_mib: float = 4.0
    ll128_mib: float = 4.6875
    ll_mib: float = 0.5


class UsedMemory(BaseModel):
    allocated_gib: float
    allocator_reserve_gib: float
    outside_allocator_gib: float
    nccl_gib: float
    nccl_by_group: dict[str, float]
    used_gib: float
    calibration: UsedCalibration


def ring_communicator_bytes(group: int, cal: UsedCalibration) -> float:
    """Receive buffers of one ring/tree collective communicator on one GPU."""
    if group <= 1:
        return 0.0
    per_channel = (cal.simple_mib + cal.ll128_mib + cal.ll_mib) * MIB
    peers = 1 if group == 2 else 2
    return cal.ring_channels * peers * per_channel


def p2p_communicator_bytes(peers: int, cal: UsedCalibration) -> float:
    """Buffers of point-to-point connections to ``peers`` GPUs (send and receive side)."""
    return peers * cal.p2p_channels_per_peer * cal.simple_mib * MIB * 2


def nccl_groups(tp: int, pp: int, cp: int, ep: int, etp: int, dp: int, edp: int,
                cal: UsedCalibration | None = None) -> dict[str, float]:
    """Per GPU: the communicators megatron-core opens for a layout and the buffers each needs (GiB)."""
    cal = cal or UsedCalibration()
    groups = {
        "tp": ring_communicator_bytes(tp, cal),
        "cp": ring_communicator_bytes(cp, cal) + p2p_communicator_bytes(cp - 1, cal),
        "dp": ring_communicator_bytes(dp * cp, cal),
        "ep (all-to-all)": p2p_communicator_bytes(ep - 1, cal),
        "etp": ring_communicator_bytes(etp, cal),
        "expert dp": ring_communicator_bytes(edp, cal),
        "pp (send/recv)": p2p_communicator_bytes(min(pp - 1, 2), cal),
        "embedding": ring_communicator_bytes(2 if pp > 1 else 1, cal),
    }
    return {k: v / GIB for k, v in groups.items() if v}


def used_memory(allocated_gib: float, *, tp: int, pp: int, cp: int, ep: int, etp: int, dp: int, edp: int,
                cal: UsedCalibration | None = None) -> UsedMemory:
    cal = cal or UsedCalibration()
    nccl = nccl_groups(tp, pp, cp, ep, etp, dp, edp, cal)
    reserve = allocated_gib * cal.allocator_reserve_fraction
    used = allocated_gib + reserve + cal.outside_allocator_gib + sum(nccl.values())
    return UsedMemory(allocated_gib=allocated_gib, allocator_reserve_gib=reserve,
                      outside_allocator_gib=cal.outside_allocator_gib, nccl_gib=sum(nccl.values()), nccl_by_group=nccl,
                      used_gib=used, calibration=cal)
