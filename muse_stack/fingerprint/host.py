"""The machine: OS, kernel, CPU, memory, glibc, container runtime and scheduler hints."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

from muse_stack.fingerprint.absent import absent, guarded

SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_CLUSTER_NAME",
    "SLURM_JOB_PARTITION",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_GPUS_ON_NODE",
    "SLURM_CPUS_ON_NODE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
)
KUBERNETES_VARS = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_PORT")


def parse_os_release(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if "=" not in line or line.lstrip().startswith("#"):
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = value.strip().strip('"').strip("'")
    return out


def _os() -> dict[str, Any]:
    for candidate in ("/etc/os-release", "/usr/lib/os-release"):
        path = Path(candidate)
        if path.exists():
            rel = parse_os_release(path.read_text())
            return {
                "pretty_name": rel.get("PRETTY_NAME", absent(f"{candidate} has no PRETTY_NAME")),
                "id": rel.get("ID", absent(f"{candidate} has no ID")),
                "version_id": rel.get("VERSION_ID", absent(f"{candidate} has no VERSION_ID")),
            }
    return absent("no /etc/os-release or /usr/lib/os-release")


def parse_cpuinfo(text: str) -> dict[str, Any]:
    model = None
    sockets: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "cpu model") and model is None:
            model = value.strip()
        elif key == "physical id":
            sockets.add(value.strip())
    return {"model": model, "sockets": len(sockets) or None}


def _cpu() -> dict[str, Any]:
    info = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": info["model"] or absent("/proc/cpuinfo has no model name line (e.g. some aarch64 kernels)"),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity if affinity is not None else absent("sched_getaffinity unavailable"),
        "sockets": info["sockets"] or absent("/proc/cpuinfo has no physical id lines"),
        "machine": platform.machine(),
    }


def _memory_total_bytes() -> Any:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            kib = int(line.split()[1])
            return kib * 1024
    return absent("/proc/meminfo has no MemTotal")


def _glibc() -> Any:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        value = None
    if value:
        return value.split()[-1]
    lib, ver = platform.libc_ver()
    return ver if lib == "glibc" and ver else absent("not a glibc system (CS_GNU_LIBC_VERSION unset)")


def parse_containerenv(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in ("engine", "name", "image", "imageid", "rootless"):
            out[key.strip()] = value.strip().strip('"')
    return out


def _container() -> dict[str, Any]:
    dockerenv = Path("/.dockerenv").exists()
    containerenv_path = Path("/run/.containerenv")
    containerenv: Any = False
    if containerenv_path.exists():
        try:
            containerenv = parse_containerenv(containerenv_path.read_text()) or True
        except OSError:
            containerenv = True  # present but unreadable: the presence is the hint
    try:
        cgroup = Path("/proc/self/cgroup").read_text().splitlines()[:32]
    except OSError as exc:
        cgroup = absent(f"/proc/self/cgroup unreadable: {exc.strerror}")
    joined = "\n".join(cgroup) if isinstance(cgroup, list) else ""
    hints = []
    if dockerenv:
        hints.append("docker")
    if containerenv:
        engine = containerenv.get("engine", "") if isinstance(containerenv, dict) else ""
        hints.append(f"podman ({engine})" if engine else "podman")
    if "kubepods" in joined or os.environ.get("KUBERNETES_SERVICE_HOST"):
        hints.append("kubernetes")
    for word in ("docker", "libpod", "containerd", "crio", "lxc"):
        if word in joined and word not in " ".join(hints):
            hints.append(word)
    if os.environ.get("container"):
        hints.append(f"container={os.environ['container']}")
    return {
        "dockerenv": dockerenv,
        "containerenv": containerenv,
        "cgroup": cgroup,
        "runtime_hints": hints,
    }


def _scheduler() -> dict[str, Any]:
    if os.environ.get("SLURM_JOB_ID"):
        slurm: Any = {name: os.environ[name] for name in SLURM_VARS if name in os.environ}
    else:
        slurm = absent("not running under Slurm (SLURM_JOB_ID unset)")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s: Any = {"in_cluster": True}
    else:
        k8s = absent("not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset)")
    return {"slurm": slurm, "kubernetes": k8s}


def collect() -> dict[str, Any]:
    uname = platform.uname()
    return {
        "hostname": socket.gethostname(),
        "os": guarded("reading os-release", _os),
        "kernel": uname.release,
        "cpu": guarded("reading /proc/cpuinfo", _cpu),
        "memory_total_bytes": guarded("reading /proc/meminfo", _memory_total_bytes),
        "glibc": guarded("reading the glibc version", _glibc),
        "container": guarded("probing the container runtime", _container),
        "scheduler": _scheduler(),
    }
