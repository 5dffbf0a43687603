"""Inter-node network stack: EFA installer, libfabric, the aws-ofi-nccl plugin, NCCL_NET choice."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from muse_stack.fingerprint import hashing, procmaps
from muse_stack.fingerprint.absent import absent

EFA_PACKAGES_FILE = "/opt/amazon/efa_installed_packages"
FI_INFO_FALLBACK = "/opt/amazon/efa/bin/fi_info"
OFI_NCCL_CANDIDATES = (
    "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so",
    "/opt/amazon/ofi-nccl/lib/libnccl-net.so",
    "/opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so",
    "/opt/amazon/ofi-nccl/lib64/libnccl-net.so",
    "/opt/aws-ofi-nccl/lib/libnccl-net.so",
    "/opt/aws-ofi-nccl/lib/libnccl-net-ofi.so",
    "/usr/local/lib/libnccl-net.so",
)
_OFI_VERSION = re.compile(rb"aws-ofi-nccl[ -]v?(\d+\.\d+(?:\.\d+)?(?:[-.+~]?[A-Za-z0-9]+)*)")
MAX_PLUGIN_SCAN_BYTES = 256 << 20


def parse_efa_installed_packages(text: str) -> dict[str, Any]:
    """The installer writes '# EFA installer version: X' then one installed package per line."""
    version = None
    packages = []
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"#\s*EFA installer version:\s*(\S+)", line)
        if m:
            version = m.group(1)
        elif line and not line.startswith("#"):
            packages.append(line)
    return {
        "installer_version": version or absent(f"{EFA_PACKAGES_FILE} has no 'EFA installer version' line"),
        "packages": packages,
    }


def parse_fi_info_version(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "libfabric":
            out["version"] = value
        elif key == "libfabric api":
            out["api"] = value
    if "version" not in out:
        return absent(f"fi_info --version printed no 'libfabric:' line: {text.strip()[:200]!r}")
    return out


def _efa() -> Any:
    path = Path(EFA_PACKAGES_FILE)
    if not path.exists():
        return absent(f"EFA installer not present ({EFA_PACKAGES_FILE} missing)")
    return parse_efa_installed_packages(path.read_text(errors="replace"))


def _libfabric(loaded: list[str]) -> Any:
    fi_info = shutil.which("fi_info") or (FI_INFO_FALLBACK if os.access(FI_INFO_FALLBACK, os.X_OK) else None)
    if fi_info is None:
        return absent(f"fi_info not found on PATH or at {FI_INFO_FALLBACK} (libfabric not installed)")
    try:
        proc = subprocess.run([fi_info, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as exc:
        return absent(f"{fi_info} --version failed: {exc}")
    if proc.returncode != 0:
        return absent(f"{fi_info} --version exited {proc.returncode}: {proc.stderr.strip()[:200]}")
    info = parse_fi_info_version(proc.stdout)
    if isinstance(info, dict) and "version" in info:
        info["fi_info"] = fi_info
        mapped = procmaps.find_loaded(loaded, r"^libfabric\.so")
        info["loaded_library"] = hashing.file_record(mapped[0]) if mapped else absent(
            "libfabric not mapped in this process (NCCL loads it when the first communicator is created)"
        )
    return info


def plugin_version_from_binary(path: str) -> Any:
    """The plugin logs 'NET/OFI Initializing aws-ofi-nccl <version>'; that string is in the binary."""
    size = os.path.getsize(path)
    if size > MAX_PLUGIN_SCAN_BYTES:
        return absent(f"{path} is {size} bytes; not scanned for its version string")
    with open(path, "rb") as fh:
        m = _OFI_VERSION.search(fh.read())
    if not m:
        return absent(f"no 'aws-ofi-nccl <version>' string in {path}")
    return m.group(1).decode(errors="replace")


def plugin_candidates() -> list[str]:
    """Where NCCL would look: libnccl-net-<NCCL_NET_PLUGIN>.so / libnccl-net.so on LD_LIBRARY_PATH, then AWS paths."""
    names = []
    plugin = os.environ.get("NCCL_NET_PLUGIN")
    if plugin and plugin.lower() != "none":
        names.append(plugin if plugin.startswith("/") or plugin.endswith(".so") else f"libnccl-net-{plugin}.so")
    names.append("libnccl-net.so")
    found = []
    for name in names:
        if name.startswith("/"):
            found.append(name)
            continue
        for directory in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
            found.append(os.path.join(directory, name))
    found.extend(OFI_NCCL_CANDIDATES)
    return [p for p in dict.fromkeys(found) if os.path.isfile(p)]


def _ofi_nccl(loaded: list[str]) -> Any:
    mapped = procmaps.find_loaded(loaded, r"^libnccl-net")
    candidates = mapped or plugin_candidates()
    if not candidates:
        return absent("aws-ofi-nccl plugin not found (no libnccl-net*.so on LD_LIBRARY_PATH or under /opt/amazon/ofi-nccl)")
    path = candidates[0]
    return {
        "path": path,
        "loaded": bool(mapped),
        "version": plugin_version_from_binary(path),
        "library": hashing.file_record(path),
        "other_candidates": candidates[1:],
    }


def _selection() -> dict[str, Any]:
    return {
        name: os.environ.get(name, absent(f"{name} unset (NCCL default)"))
        for name in ("NCCL_NET", "NCCL_NET_PLUGIN", "FI_PROVIDER", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME")
    }


def _rdma_devices() -> Any:
    base = Path("/sys/class/infiniband")
    if not base.is_dir():
        return absent("no /sys/class/infiniband (no RDMA devices visible)")
    return sorted(p.name for p in base.iterdir())


def collect() -> dict[str, Any]:
    loaded = procmaps.loaded_shared_objects()
    return {
        "efa": _efa(),
        "libfabric": _libfabric(loaded),
        "aws_ofi_nccl": _ofi_nccl(loaded),
        "plugin_selection": _selection(),
        "rdma_devices": _rdma_devices(),
    }
