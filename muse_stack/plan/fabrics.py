"""The links a collective crosses, priced at the published bandwidth of each machine's fabrics.

The fabrics and their figures are the machine table's (``muse_stack/machine/machines.yaml``,
:class:`muse_stack.machine.table.Fabric`): each carries the figure the model uses, as NCCL's tests
define bus bandwidth (bytes each GPU moves over its links per second, one direction), and where it
comes from: a **measured** figure (an NCCL maintainer's or a vendor's published nccl-tests result)
where one is published, else a **line rate** (the datasheet figure, before protocol overhead), or a
figure **derived** from others (stated how). Every figure names its source and the sentence it
comes from. Nothing there is fitted to any run of this project or to the B200 record. Each
machine has one scale-out fabric: the one the launcher sets up by default.

Which fabric a group crosses follows from the layout (:func:`muse_stack.plan.cost.group_links`):
ranks of one NVLink domain (an HGX node of 8, or a GB200 NVL72 rack) talk over NVLink, the others
over the GPU's scale-out NICs. NCCL's maintainers state that an all-to-all does not aggregate
NICs: its network share runs at one NIC's bandwidth per GPU (:data:`ALLTOALL_ONE_NIC`,
:attr:`Fabric.alltoall_gbps`), which is how the model prices it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from muse_stack.machine.table import Fabric, Figure

__all__ = ["ALLTOALL_ONE_NIC", "Fabric", "Figure", "Links"]

#: NCCL's maintainer on what an all-to-all reaches across nodes
ALLTOALL_ONE_NIC = Figure(
    value=1.0, unit="GB/s", basis="measured", url="https://github.com/NVIDIA/nccl-tests/issues/267",
    quote="Alltoall cannot aggregate the bandwidth of multiple NICs, so the performance you should see is the "
          "performance of a single NIC.",
    note="the all-to-all's inter-node share runs at one NIC per GPU (value: NICs used per GPU)")


class Links(BaseModel):
    """The two fabrics of a machine and how many GPUs one NVLink domain joins."""

    model_config = ConfigDict(frozen=True)

    intra: Fabric
    inter: Fabric
    domain: int  #: GPUs one GPU reaches over NVLink

    def crossing(self, span: int) -> Fabric:
        """The fabric of a group whose ranks cover ``span`` consecutive ranks."""
        return self.intra if span <= self.domain else self.inter
