"""What a launcher needs of each machine: GPUs per node, the stack lock that builds the image, the
node's CPU cores and its default fabric, from the machine table (``muse_stack/machine/machines.yaml``,
where they live), and the NCCL settings of each fabric.

Fabrics (``launch --fabric``):

- ``efa``: AWS Elastic Fabric Adapter through the aws-ofi-nccl plugin. The images install EFA
  1.49 (libfabric and the plugin under /opt/amazon) without adding it to the library path, so
  the launcher puts it there and asks NCCL for the plugin (the AWS EFA notes,
  docs/field-notes.md, "AWS EFA in containers"); Kubernetes pods request
  ``vpc.amazonaws.com/efa`` interfaces.
- ``ib``: InfiniBand (or RoCE) through NCCL's own IB transport: no plugin, no EFA libraries;
  ``NCCL_NET=IB`` makes NCCL fail at start-up when no IB device is visible rather than fall back
  to TCP sockets without a word. Kubernetes pods get ``IPC_LOCK`` (RDMA registers pinned memory).

GB200 NVL72 nodes also join a multi-node NVLink domain (``NCCL_MNNVL_ENABLE=1``, IMEX) whatever
the fabric between domains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from muse_stack.machine.table import Transport, table, table_path
from muse_stack.util.errors import LayoutError, UsageError

_COMMON_ENV: dict[str, str] = {
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # NCCL's bootstrap on the host network, not loopback or docker
    # warnings only: INFO on every rank of a many-node job floods the logs; `launch --nccl-debug INFO`
    # (or the recipe's env) asks for more. The fingerprint reads the plugin's version from its binary.
    "NCCL_DEBUG": "WARN",
}

# settings of each fabric (the transports a machine's scale-out fabric names)
FABRIC_ENV: dict[Transport, dict[str, str]] = {
    "efa": {
        "NCCL_NET_PLUGIN": "ofi",  # libnccl-net-ofi.so from aws-ofi-nccl
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_HUGE_PAGE": "0",  # huge pages make forked workers (data loaders) run out of memory
        **_COMMON_ENV,
    },
    "ib": {
        "NCCL_NET": "IB",  # NCCL's IB verbs transport, or an error at start-up: never a silent TCP fallback
        "NCCL_IB_DISABLE": "0",
        **_COMMON_ENV,
    },
}
FABRICS: tuple[str, ...] = get_args(Transport)  # FABRIC_ENV sets up each

#: NCCL_DEBUG levels `launch --nccl-debug` takes
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


@dataclass(frozen=True)
class Target:
    gpu: str
    lock: str  # containers/locks/<lock>.toml builds this target's image
    gpus_per_node: int | None  # None: CPU processes, as many per node as the recipe says
    instance: str | None
    efa_devices: int  # EFA interfaces per node, requested as vpc.amazonaws.com/efa (fabric efa)
    cpus: int | None = None  # the instance's vCPUs: --cpus-per-gpu defaults to cpus / gpus_per_node
    fabric: str | None = None  # the default fabric (--fabric overrides it): the machine's scale-out fabric
    env: dict[str, str] = field(default_factory=dict)  # target settings beside the fabric's
    note: str = ""
    gpu_product: str | None = None  # the GPU feature discovery label nvidia.com/gpu.product
    imex: bool = False  # nodes join a multi-node NVLink domain: Kubernetes pods claim an IMEX channel

    @property
    def container(self) -> bool:
        return self.gpus_per_node is not None

    @property
    def cpus_per_gpu(self) -> int | None:
        return self.cpus // self.gpus_per_node if self.cpus and self.gpus_per_node else None


def targets() -> dict[str, Target]:
    """Every launched machine of the table in use (a row with a ``launch`` section)."""
    t = table()
    out = {}
    for name, m in t.machines.items():
        if m.launch is None or m.lock is None:
            continue
        run = m.launch
        out[name] = Target(gpu=name, lock=m.lock, gpus_per_node=m.gpus_per_node, instance=run.instance,
                           efa_devices=run.efa_devices, cpus=run.cpus,
                           fabric=t.fabric(m.fabrics.inter).transport if m.fabrics is not None else None,
                           env=dict(run.env), note=run.note, gpu_product=run.gpu_product, imex=run.imex)
    return out


def target_for(gpu: str) -> Target:
    known = targets()
    if gpu not in known:
        raise LayoutError("no launch target for this GPU type", field="hardware.gpu", value=gpu,
                          rule=f"launch targets: {', '.join(known)}",
                          fix="use a recipe for one of these targets, or give the machine a lock and a launch section "
                              f"in the machine table ({table_path()}) with a stack lock under containers/locks/")
    return known[gpu]


def fabric_for(target: Target, fabric: str | None) -> str | None:
    """The fabric a launch uses: ``--fabric``, else the target's default; None for CPU processes."""
    if fabric is not None and fabric not in FABRICS:
        raise UsageError("not a fabric", field="--fabric", value=fabric, fix=f"use one of {', '.join(FABRICS)}")
    if not target.container:
        if fabric is not None:
            raise UsageError("CPU processes talk over gloo on TCP; there is no fabric to choose", field="--fabric",
                             value=fabric, fix="drop --fabric for a CPU recipe")
        return None
    return fabric or target.fabric
