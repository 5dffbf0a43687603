"""The links a collective crosses, with the published bandwidth the step-time model prices it at.

Each fabric carries the figure the model uses, as NCCL's tests define bus bandwidth (bytes each
GPU moves over its links per second, one direction), and where it comes from: a **measured**
figure (an NCCL maintainer's or a vendor's published nccl-tests result) where one is published,
else a **line rate** (the datasheet figure, before protocol overhead), or a figure **derived** from
the two (stated how). Every figure names its source and the sentence it comes from. Nothing here
is fitted to any run of this project or to the B200 record.

Which fabric a group crosses follows from the layout (:func:`muse_stack.plan.cost.group_links`):
ranks of one NVLink domain (an HGX node of 8, or a GB200 NVL72 rack) talk over NVLink, the others
over the GPU's own scale-out NIC (one 400 Gb/s NIC per GPU on every system below). NCCL's
maintainers state that an all-to-all does not aggregate NICs: its network share runs at one NIC's
bandwidth per GPU (:data:`ALLTOALL_ONE_NIC`), which is how the model prices it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Figure(BaseModel):
    """One published number, with its source."""

    model_config = ConfigDict(frozen=True)

    value: float
    unit: Literal["GB/s", "us"]
    basis: Literal["measured", "line rate", "derived"]
    url: str
    quote: str  #: the sentence (or table row) the value comes from, as published
    note: str = ""  #: how the value follows from the quote, where it is not the quoted number itself


class Fabric(BaseModel):
    """One link kind: its bus bandwidth per GPU and direction, and the time of a small collective
    over it (the latency every collective that crosses it pays once)."""

    model_config = ConfigDict(frozen=True)

    name: str
    scope: Literal["intra-node", "inter-node"]
    line_rate: Figure  #: per GPU, per direction
    bus: Figure  #: what NCCL reaches (the figure the model uses); the line rate where nothing measured is published
    latency: Figure | None = None  #: None: no small-message figure published; taken as 0 (bandwidth-bound sizes)

    @property
    def gbps(self) -> float:
        return self.bus.value

    @property
    def latency_s(self) -> float:
        return self.latency.value * 1e-6 if self.latency is not None else 0.0

    def describe(self) -> str:
        return f"{self.name} {self.gbps:,.0f} GB/s ({self.bus.basis})"


#: NCCL's maintainer on what an all-to-all reaches across nodes
ALLTOALL_ONE_NIC = Figure(
    value=1.0, unit="GB/s", basis="measured", url="https://github.com/NVIDIA/nccl-tests/issues/267",
    quote="Alltoall cannot aggregate the bandwidth of multiple NICs, so the performance you should see is the "
          "performance of a single NIC.",
    note="the all-to-all's inter-node share runs at one NIC per GPU (value: NICs used per GPU)")

NVLINK4 = Fabric(
    name="NVLink 4 (HGX H100/H200)", scope="intra-node",
    line_rate=Figure(
        value=450.0, unit="GB/s", basis="line rate", url="https://github.com/NVIDIA/nccl-tests/issues/212",
        quote="450GB/s is the line rate."),
    bus=Figure(
        value=370.0, unit="GB/s", basis="measured", url="https://github.com/NVIDIA/nccl-tests/issues/212",
        quote="With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you "
              "can observe as \"BusBw\" when running non-allreduce operations, or when running with NCCL_ALGO=RING.",
        note="NCCL's maintainer (sjeaugey) on 8 x H100; all-gather, reduce-scatter, all-to-all and send/receive "
             "all reach it"),
)

NVLINK5 = Fabric(
    name="NVLink 5 (HGX B200)", scope="intra-node",
    line_rate=Figure(
        value=900.0, unit="GB/s", basis="line rate",
        url="https://raw.githubusercontent.com/mlcommons/inference_results_v6.0/main/closed/Nebius/systems/"
            "nebius_b200_n1.json",
        quote="\"accelerator_interconnect\": \"18x 5th Gen NVLink, 14.4 TB/s aggregated bandwidth\"",
        note="14.4 TB/s over 8 GPUs is 1.8 TB/s per GPU, both directions: 900 GB/s each way"),
    bus=Figure(
        value=900.0 * 370.0 / 450.0, unit="GB/s", basis="derived",
        url="https://github.com/NVIDIA/nccl-tests/issues/212",
        quote="With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s",
        note="no NCCL bus bandwidth of 8 x B200 is published in the sources read; NVLink 4's measured share of its "
             "line rate (370 / 450) applied to NVLink 5's 900 GB/s: 740 GB/s. NVIDIA states the advertised rates "
             "are \"the raw line rate before any protocol or error correction overheads\" "
             "(https://github.com/NVIDIA/nccl-tests/issues/366)"),
)

NVLINK5_NVL72 = NVLINK5.model_copy(update={"name": "NVLink 5 (GB200 NVL72)"})

IB_NDR = Fabric(
    name="InfiniBand NDR (ConnectX-7, 1 per GPU)", scope="inter-node",
    line_rate=Figure(
        value=50.0, unit="GB/s", basis="line rate", url="https://github.com/NVIDIA/nccl-tests/issues/389",
        quote="Nodes are equipped with ConnectX-7 NDR 400 Gb/s InfiniBand.",
        note="400 Gb/s = 50 GB/s per port, one port per GPU"),
    bus=Figure(
        value=48.0, unit="GB/s", basis="measured", url="https://github.com/NVIDIA/nccl-tests/issues/319",
        quote="You should achieve around 48GB/s from each CX7 NIC at 400Gbps.",
        note="NVIDIA's NCCL team (AddyLaddy); the same thread: up to ~396 GB/s per 8-GPU node with the ring"),
    latency=Figure(
        value=47.54, unit="us", basis="measured", url="https://github.com/NVIDIA/nccl/issues/1244",
        quote="Test in 2 nodes, 16 H20 GPUs ,16 cx7 NICs(IB NDR) with NCCL-2.21.5 + cuda-12.3: ... 4 1 float sum "
              "47.54",
        note="a 4-byte all-reduce over 2 nodes of 8 (nccl-tests, out of place): an upper bound on one collective's "
             "fixed time"),
)

EFA_P6_B200 = Fabric(
    name="EFAv4 (p6-b200.48xlarge, 400 Gb/s per GPU)", scope="inter-node",
    line_rate=Figure(
        value=50.0, unit="GB/s", basis="line rate", url="recipes/attune-b200.yaml (stack.network, from the record)",
        quote="8 GPUs per node, EFA 1.49 (aws-ofi-nccl 1.20), 3.2 Tb/s RDMA per node",
        note="AWS p6-b200.48xlarge: 3,200 Gb/s EFAv4 per instance of 8 GPUs, 400 Gb/s = 50 GB/s per GPU"),
    bus=Figure(
        value=50.0, unit="GB/s", basis="line rate", url="recipes/attune-b200.yaml (stack.network, from the record)",
        quote="8 GPUs per node, EFA 1.49 (aws-ofi-nccl 1.20), 3.2 Tb/s RDMA per node",
        note="no large-message EFA bus bandwidth of p6-b200 is published in the sources read: the line rate, an "
             "upper bound (InfiniBand NDR reaches 48 of its 50 GB/s)"),
    latency=Figure(
        value=50.58, unit="us", basis="measured", url="https://github.com/dstackai/dstack/pull/3961",
        quote="NCCL tests on 2x p6-200: ... 8 2 float sum -1 50.58",
        note="an 8-byte all-reduce over 2 x p6-b200 (nccl-tests, out of place): an upper bound on one collective's "
             "fixed time"),
)


class Links(BaseModel):
    """The two fabrics of a machine and how many GPUs one NVLink domain joins."""

    model_config = ConfigDict(frozen=True)

    intra: Fabric
    inter: Fabric
    domain: int  #: GPUs one GPU reaches over NVLink

    def crossing(self, span: int) -> Fabric:
        """The fabric of a group whose ranks cover ``span`` consecutive ranks."""
        return self.intra if span <= self.domain else self.inter


def machine_links(gpu: str, instance: str | None, domain: int) -> Links | None:
    """The fabrics of ``gpu`` (on ``instance`` where the recipe names one), or None when no
    published figure covers it."""
    inst = (instance or "").lower()
    if gpu in ("H100", "H200"):
        return Links(intra=NVLINK4, inter=IB_NDR, domain=domain)
    if gpu == "B200":
        return Links(intra=NVLINK5, inter=EFA_P6_B200 if "p6-b200" in inst else IB_NDR, domain=domain)
    if gpu == "GB200":
        return Links(intra=NVLINK5_NVL72, inter=IB_NDR, domain=domain)
    return None
