"""Memory as ``nvidia-smi`` sees it: the allocated estimate plus what sits outside the allocator.

    used = allocated x (1 + allocator reserve) + CUDA context + library workspaces + NCCL buffers

NCCL buffers follow NCCL's defaults: every ring or tree collective communicator keeps, per
channel, a receive buffer for each protocol (NCCL's defaults: Simple 4 MiB = NCCL_BUFFSIZE,
LL128 120 x 640 x 8 x 8 B = 4.6875 MiB, LL 8 x 512 x 8 x 16 B = 0.5 MiB) from each of its two ring neighbours; a point-to-point or all-to-all communicator
keeps a Simple buffer per peer and per peer channel. Channel counts are NCCL's defaults for
the link: 16 ring channels over NVLink or the network, 2 channels per point-to-point peer
(NCCL_NCHANNELS_PER_NET_PEER; NVLink peers get the same here).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MIB = 2**20
GIB = 2**30


class UsedCalibration(BaseModel):
    model_config = ConfigDict(frozen=True)

    # Not measured: the H200 runs in benchmarks/ record torch.cuda.max_memory_allocated only (no
    # reserved figure), so the caching allocator's reserve over allocated is not known from this
    # project's measurements. 0 until a run records max_memory_reserved; the plan says so.
    allocator_reserve_fraction: float = 0.0
    allocator_reserve_source: str = "not measured: benchmarks/*/results.json record allocated memory only"
    # The CUDA context of a sm90/sm100 process with cuBLAS, cuDNN and NCCL loaded, and the
    # workspaces TE and cuBLAS allocate per stream (NVIDIA documents no fixed figure; these are
    # stated assumptions, printed with every plan).
    cuda_context_gib: float = 0.5
    workspaces_gib: float = 0.125  # cuBLAS(Lt) 32 MiB x 2 streams, TE's 32 MiB, cuDNN's attention workspace
    ring_channels: int = 16
    p2p_channels_per_peer: int = 2
    simple_mib: float = 4.0
    ll128_mib: float = 4.6875
    ll_mib: float = 0.5


class UsedMemory(BaseModel):
    allocated_gib: float
    allocator_reserve_gib: float
    cuda_context_gib: float
    workspaces_gib: float
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
    used = allocated_gib + reserve + cal.cuda_context_gib + cal.workspaces_gib + sum(nccl.values())
    return UsedMemory(allocated_gib=allocated_gib, allocator_reserve_gib=reserve, cuda_context_gib=cal.cuda_context_gib,
                      workspaces_gib=cal.workspaces_gib, nccl_gib=sum(nccl.values()), nccl_by_group=nccl,
                      used_gib=used, calibration=cal)
