"""Per-target facts a launcher needs: GPUs per node, the stack lock that builds the image, the
instance's EFA interfaces and the NCCL/EFA environment. This table is the one place they live.

The network settings follow the AWS EFA notes (docs/field-notes.md, "AWS EFA in containers"):
the images install EFA 1.49 (libfabric and the aws-ofi-nccl plugin under /opt/amazon) without
adding it to the library path, so the launcher puts it there and asks NCCL for the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from muse_stack.errors import LayoutError

# where the EFA installer puts libfabric and the aws-ofi-nccl plugin in the image (prepended to the
# image's own LD_LIBRARY_PATH inside the container, so the CUDA base's entries stay)
EFA_LIBRARY_PATH = "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib"

# settings every EFA target shares
_EFA_ENV: dict[str, str] = {
    "NCCL_NET_PLUGIN": "ofi",  # libnccl-net-ofi.so from aws-ofi-nccl
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_HUGE_PAGE": "0",  # huge pages make forked workers (data loaders) run out of memory
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # NCCL's bootstrap on the host network, not loopback or docker
    # warnings only: INFO on every rank of a many-node job floods the logs; `launch --nccl-debug INFO`
    # (or the recipe's env) asks for more. The fingerprint reads the plugin's version from its binary.
    "NCCL_DEBUG": "WARN",
}

#: NCCL_DEBUG levels `launch --nccl-debug` takes
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


@dataclass(frozen=True)
class Target:
    gpu: str
    lock: str  # containers/locks/<lock>.toml builds this target's image
    gpus_per_node: int | None  # None: CPU processes, as many per node as the recipe says
    instance: str | None
    efa_devices: int  # EFA interfaces per node, requested as vpc.amazonaws.com/efa
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def container(self) -> bool:
        return self.gpus_per_node is not None


TARGETS: dict[str, Target] = {
    # p6e-gb200.36xlarge: 4 GPUs beside one Grace CPU; 18 of them form an NVL72 UltraServer with
    # 28.8 Tb/s of EFAv4, 1.6 Tb/s per node = 4 x 400 Gb/s interfaces; IMEX joins the NVLink domain
    "GB200": Target("GB200", "gb200", 4, "p6e-gb200.36xlarge", 4,
                    {**_EFA_ENV, "NCCL_MNNVL_ENABLE": "1"}, "72-GPU NVLink domain (IMEX)"),
    # p6-b200.48xlarge: 8 GPUs, 8 x 400 Gb/s EFAv4 (3.2 Tb/s, as the B200 record states)
    "B200": Target("B200", "b200", 8, "p6-b200.48xlarge", 8, dict(_EFA_ENV), "3.2 Tb/s EFA per node"),
    # p5en.48xlarge: 8 GPUs, 16 x 200 Gb/s EFAv3 (3.2 Tb/s)
    "H200": Target("H200", "h200", 8, "p5en.48xlarge", 16, dict(_EFA_ENV), "3.2 Tb/s EFA per node"),
    "cpu": Target("cpu", "cpu", None, None, 0, {}, "CPU processes, gloo"),
}


def target_for(gpu: str) -> Target:
    if gpu not in TARGETS:
        raise LayoutError("no launch target for this GPU type", field="hardware.gpu", value=gpu,
                          rule=f"launch targets: {', '.join(TARGETS)}",
                          fix="use a recipe for one of these targets, or add the target to muse_stack/launch/targets.py "
                              "with a stack lock under containers/locks/")
    return TARGETS[gpu]
