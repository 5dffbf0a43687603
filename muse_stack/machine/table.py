"""The machine table: every machine muse-stack plans for and launches on, read from
``muse_stack/machine/machines.yaml`` (or the copy ``$MUSE_STACK_MACHINES`` names) and checked here.

Each row owns a machine's facts: its GPU's stated figures (memory, peak rates, each with its
source), arch, platform, GPUs per node, NVLink domain, its two fabrics (the scale-out one is both
what the launcher sets up and what the planner prices), the stack lock that builds its image and
what the launcher needs of its instance. Everything else derives from it: the recipe's
``hardware.gpu`` values, :mod:`muse_stack.machine.hardware` (the planner's and MFU's GPU figures),
:mod:`muse_stack.launch.targets` and the lock targets of :mod:`muse_stack.stack.lock`.

A table that breaks a rule (a fabric it does not define, a line rate that is not the GPU's
datasheet figure, a launch row without a lock, ...) is refused with the field and the fix.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from muse_stack.util.errors import InputError

#: the table muse-stack ships
DEFAULT_PATH = Path(__file__).with_name("machines.yaml")
#: names another table file (a site's own machines) in place of the shipped one
ENV = "MUSE_STACK_MACHINES"

#: what an image is built for (containers/locks/<lock>.toml states the same)
Platform = Literal["linux/amd64", "linux/arm64"]
#: NCCL's transport across nodes, as ``launch --fabric`` names it
Transport = Literal["efa", "ib"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Figure(_Strict):
    """One published number, with its source."""

    value: float
    unit: Literal["GB/s", "us"]
    basis: Literal["measured", "line rate", "derived"]
    url: str = Field(min_length=1)
    quote: str = Field(min_length=1)  #: the sentence (or table row) the value comes from, as published
    note: str = ""  #: how the value follows from the quote, where it is not the quoted number itself


class Fabric(_Strict):
    """One link kind: its bus bandwidth per GPU and direction, and the time of a small collective
    over it (the latency every collective that crosses it pays once)."""

    name: str
    scope: Literal["intra-node", "inter-node"]
    line_rate: Figure  #: per GPU, per direction
    bus: Figure  #: what NCCL reaches (the figure the model uses); the line rate where nothing measured is published
    latency: Figure | None = None  #: None: no small-message figure published; taken as 0 (bandwidth-bound sizes)
    transport: Transport | None = None  #: a scale-out fabric's NCCL transport (the launcher's --fabric)
    nics_per_gpu: int = Field(1, ge=1)  #: the GPU's bus bandwidth is spread over this many NICs

    @model_validator(mode="after")
    def _rules(self) -> Fabric:
        if (self.scope == "inter-node") != (self.transport is not None):
            raise ValueError("a scale-out (inter-node) fabric names its transport, an NVLink one none")
        if not 0 < self.bus.value <= self.line_rate.value:
            raise ValueError(f"bus bandwidth {self.bus.value} must be positive and at most the line rate "
                             f"{self.line_rate.value} (what NCCL reaches never exceeds the wire)")
        if self.bus.unit != "GB/s" or self.line_rate.unit != "GB/s" or (self.latency and self.latency.unit != "us"):
            raise ValueError("bandwidths are in GB/s, the latency in us")
        return self

    @property
    def gbps(self) -> float:
        return self.bus.value

    @property
    def alltoall_gbps(self) -> float:
        """An all-to-all's rate across this fabric: one NIC's share (an all-to-all does not aggregate
        NICs: :data:`muse_stack.plan.fabrics.ALLTOALL_ONE_NIC`)."""
        return self.bus.value / self.nics_per_gpu

    @property
    def latency_s(self) -> float:
        return self.latency.value * 1e-6 if self.latency is not None else 0.0

    def describe(self) -> str:
        one_nic = (f", an all-to-all {self.alltoall_gbps:,.0f} GB/s on one of {self.nics_per_gpu} NICs"
                   if self.nics_per_gpu > 1 else "")
        return f"{self.name} {self.gbps:,.0f} GB/s ({self.bus.basis}{one_nic})"


class Memory(_Strict):
    """Memory per GPU as its source states it."""

    value: float = Field(gt=0)
    unit: Literal["MiB", "GiB", "GB"]
    source: str = Field(min_length=1)

    @property
    def gib(self) -> float:
        if self.unit == "MiB":
            return self.value / 1024
        if self.unit == "GB":
            return self.value * 1e9 / 2**30
        return self.value


class Gpu(_Strict):
    """A GPU's stated figures (bandwidths per direction, per GPU), each with its source."""

    arch: str = Field(pattern=r"^sm\d{2,3}$")
    memory: Memory
    peak_bf16_tflops: float = Field(gt=0)
    peak_source: str = Field(min_length=1)
    #: dense FP8 tensor-core peak (the rate of FP8 GEMMs, current or MX scaling); None where not stated
    peak_fp8_tflops: float | None = Field(None, gt=0)
    peak_fp8_source: str | None = None
    hbm_gbps: float = Field(gt=0)
    hbm_source: str = Field(min_length=1)
    nvlink_gbps: float = Field(gt=0)
    nvlink_source: str = Field(min_length=1)
    scaleout_gbps: float = Field(gt=0)
    scaleout_source: str = Field(min_length=1)

    @property
    def capability(self) -> str:
        """The CUDA capability a lock lists for this arch: sm90 is "9.0", sm100 "10.0"."""
        digits = self.arch[2:]
        return f"{digits[:-1]}.{digits[-1]}"


class MachineFabrics(_Strict):
    intra: str  #: a key of the table's fabrics: the NVLink domain
    inter: str  #: the scale-out network between domains


class Launch(_Strict):
    """What the launcher needs of the machine's instance."""

    instance: str | None = None
    cpus: int | None = Field(None, gt=0)  #: the instance's vCPUs: --cpus-per-gpu defaults to cpus / GPUs per node
    efa_devices: int = Field(0, ge=0)  #: EFA interfaces per node, requested as vpc.amazonaws.com/efa
    env: dict[str, str] = {}  #: settings beside the fabric's (the recipe's env overrides both)
    note: str = ""
    gpu_product: str | None = None  #: the GPU feature discovery label nvidia.com/gpu.product
    imex: bool = False  #: nodes join a multi-node NVLink domain: Kubernetes pods claim an IMEX channel


class GpuSpec(_Strict):
    """A GPU machine as the planner and the MFU figures see it: the row's GPU figures with its node
    and its two fabrics resolved."""

    name: str
    memory_gib: float
    memory_source: str
    peak_bf16_tflops: float
    peak_source: str
    arch: str
    peak_fp8_tflops: float | None = None  #: dense FP8 peak (None: not stated)
    peak_fp8_source: str | None = None
    per_node_default: int
    hbm_gbps: float
    hbm_source: str
    nvlink_gbps: float
    nvlink_domain: int  #: GPUs one NVLink domain joins
    nvlink_source: str
    scaleout_gbps: float
    scaleout_source: str
    intra: Fabric  #: the NVLink fabric
    inter: Fabric  #: the scale-out fabric


class Machine(_Strict):
    """One row of the table."""

    platform: Platform
    lock: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    gpus_per_node: int | None = Field(None, gt=0)
    nvlink_domain: int | None = Field(None, gt=0)
    fabrics: MachineFabrics | None = None
    gpu: Gpu | None = None
    launch: Launch | None = None

    @model_validator(mode="after")
    def _rules(self) -> Machine:
        node = {"gpus_per_node": self.gpus_per_node, "nvlink_domain": self.nvlink_domain, "fabrics": self.fabrics}
        if self.gpu is not None:
            missing = [k for k, v in node.items() if v is None]
            if missing:
                raise ValueError(f"a GPU machine states {', '.join(missing)}")
            if max(self.nvlink_domain, self.gpus_per_node) % min(self.nvlink_domain, self.gpus_per_node):
                raise ValueError("an NVLink domain is whole nodes, or a node whole domains")
        else:
            given = [k for k, v in node.items() if v is not None]
            if given:
                raise ValueError(f"a machine without a gpu has no {', '.join(given)} (CPU processes)")
        if self.launch is not None and self.lock is None:
            raise ValueError("a launched machine names the lock that builds its image")
        if self.gpu is None and self.launch is not None and (self.launch.efa_devices or self.launch.imex):
            raise ValueError("CPU processes have no EFA interfaces or NVLink domain")
        return self


class Table(_Strict):
    fabrics: dict[str, Fabric]
    machines: dict[str, Machine] = Field(min_length=1)

    @model_validator(mode="after")
    def _rules(self) -> Table:
        locks: dict[str, str] = {}
        for name, m in self.machines.items():
            if m.lock is not None:
                if m.lock in locks:
                    raise _Rule(f"machines.{name}.lock", f"{locks[m.lock]} and {name} name the same lock {m.lock}",
                                "give each machine its own lock (containers/locks/<lock>.toml)")
                locks[m.lock] = name
            if m.fabrics is None or m.gpu is None:
                continue
            for part, scope, rate, what in (("intra", "intra-node", m.gpu.nvlink_gbps, "nvlink_gbps"),
                                             ("inter", "inter-node", m.gpu.scaleout_gbps, "scaleout_gbps")):
                key = getattr(m.fabrics, part)
                where = f"machines.{name}.fabrics.{part}"
                if key not in self.fabrics:
                    raise _Rule(where, f"no fabric {key!r} in the table", f"use one of {', '.join(self.fabrics)}")
                fabric = self.fabrics[key]
                if fabric.scope != scope:
                    raise _Rule(where, f"{key} is an {fabric.scope} fabric", f"name an {scope} fabric")
                if fabric.line_rate.value != rate:
                    raise _Rule(where, f"{key}'s line rate {fabric.line_rate.value:g} GB/s is not the GPU's "
                                f"gpu.{what} {rate:g} GB/s", f"name the fabric of this machine's links, or correct "
                                f"gpu.{what}")
            inter = self.fabrics[m.fabrics.inter]
            if inter.transport == "efa":
                efa = m.launch.efa_devices if m.launch is not None else 0
                if m.launch is not None and efa != inter.nics_per_gpu * m.gpus_per_node:
                    raise _Rule(f"machines.{name}.launch.efa_devices",
                                f"{m.fabrics.inter} has {inter.nics_per_gpu} NIC(s) per GPU, {m.gpus_per_node} GPUs "
                                f"per node: {inter.nics_per_gpu * m.gpus_per_node} EFA interfaces, not {efa}",
                                "state the instance's EFA interfaces, or name its fabric")
        return self

    def machine(self, name: str) -> Machine:
        return self.machines[name]

    def fabric(self, key: str) -> Fabric:
        return self.fabrics[key]

    @functools.cached_property
    def gpus(self) -> dict[str, GpuSpec]:
        """The GPU machines as the planner sees them, in table order."""
        out = {}
        for name, m in self.machines.items():
            if m.gpu is None:
                continue
            g = m.gpu
            out[name] = GpuSpec(
                name=name, memory_gib=g.memory.gib, memory_source=g.memory.source,
                peak_bf16_tflops=g.peak_bf16_tflops, peak_source=g.peak_source, arch=g.arch,
                peak_fp8_tflops=g.peak_fp8_tflops, peak_fp8_source=g.peak_fp8_source,
                per_node_default=m.gpus_per_node, hbm_gbps=g.hbm_gbps, hbm_source=g.hbm_source,
                nvlink_gbps=g.nvlink_gbps, nvlink_domain=m.nvlink_domain, nvlink_source=g.nvlink_source,
                scaleout_gbps=g.scaleout_gbps, scaleout_source=g.scaleout_source,
                intra=self.fabrics[m.fabrics.intra], inter=self.fabrics[m.fabrics.inter])
        return out

    def locks(self) -> dict[str, str]:
        """lock name -> the machine whose image it builds."""
        return {m.lock: name for name, m in self.machines.items() if m.lock is not None}


class _Rule(ValueError):
    def __init__(self, field: str, rule: str, fix: str) -> None:
        super().__init__(rule)
        self.field, self.rule, self.fix = field, rule, fix


def load(path: str | os.PathLike[str]) -> Table:
    """Read and check a machine table; errors name the file, the field and the fix."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"no machine table at {path}", field=ENV, value=str(path),
                         fix=f"point {ENV} at a copy of {DEFAULT_PATH}, or unset it") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {exc}", field="file", value=str(path),
                         fix="fix the YAML syntax") from None
    try:
        return Table.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        rule = err.get("ctx", {}).get("error")
        if isinstance(rule, _Rule):
            raise InputError(f"{path}: {rule.rule}", field=rule.field, rule=rule.rule, fix=rule.fix) from None
        field = ".".join(str(x) for x in err["loc"]) or "<top>"
        raise InputError(f"{path}: {err['msg'].removeprefix('Value error, ')}", field=field,
                         value=err.get("input") if not isinstance(err.get("input"), dict) else None,
                         fix=f"correct `{field}` (see {DEFAULT_PATH} for the shipped table)") from None


@functools.lru_cache(maxsize=8)
def _cached(path: str) -> Table:
    return load(path)


def table_path() -> Path:
    """The table in use: ``$MUSE_STACK_MACHINES``, else the shipped one."""
    return Path(os.environ.get(ENV) or DEFAULT_PATH)


def table() -> Table:
    """The machine table in use (read once per file)."""
    return _cached(str(table_path()))


def machine_names() -> tuple[str, ...]:
    """Every machine, in table order: the values of a recipe's ``hardware.gpu``."""
    return tuple(table().machines)
