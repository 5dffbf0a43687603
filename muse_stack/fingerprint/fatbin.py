"""The GPU architectures a shared object carries, read from its CUDA fat binaries.

nvcc embeds device code in an ELF section named ``.nv_fatbin``: one or more fat binary
containers, each a 16-byte header (magic 0xBA55ED50, version, header size, payload size) and a
list of entries. Each entry states its kind (1: PTX, 2: a cubin of machine code for one
architecture) and the architecture as ``major * 10 + minor`` (90 for sm_90, 103 for sm_103).
Reading them needs no GPU, no driver and no CUDA tool: the stdlib parses the ELF section table
and the headers. Compressed entries keep their header uncompressed, so their architecture is
read the same way.

    archs = fatbin_archs(Path("deep_ep_cpp.cpython-312-x86_64-linux-gnu.so"))
    archs.sass  # ("7.5", "8.0", ...): the architectures with machine code
    archs.ptx   # the architectures with PTX (the driver can compile it for newer GPUs)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries after the header
# kind, version, header size, payload size, then (at offset 28) the architecture
_ENTRY = struct.Struct("<HHIQ")
_ARCH_OFFSET = 28
KIND_PTX = 1
KIND_CUBIN = 2


class FatbinError(ValueError):
    """The file is not an ELF object or its fat binary is malformed."""


@dataclass(frozen=True)
class Archs:
    sass: tuple[str, ...] = ()
    ptx: tuple[str, ...] = ()
    containers: int = 0
    entries: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, object]:
        return {"sass": list(self.sass), "ptx": list(self.ptx), "containers": self.containers,
                "entries": self.entries, **({"notes": list(self.notes)} if self.notes else {})}


def capability(arch: int) -> str:
    """90 -> "9.0", 103 -> "10.3", 120 -> "12.0" (the lock's spelling of a capability)."""
    return f"{arch // 10}.{arch % 10}"


def _sort(caps: set[str]) -> tuple[str, ...]:
    return tuple(sorted(caps, key=lambda c: tuple(int(x) for x in c.split("."))))


def parse_fatbin(blob: bytes) -> Archs:
    """The architectures of every container in a ``.nv_fatbin`` section's bytes."""
    sass: set[str] = set()
    ptx: set[str] = set()
    notes: list[str] = []
    containers = entries = 0
    pos = 0
    magic = struct.pack("<I", FATBIN_MAGIC)
    while True:
        pos = blob.find(magic, pos)
        if pos < 0:
            break
        if pos + _HEADER.size > len(blob):
            raise FatbinError(f"fat binary header cut short at offset {pos}")
        _, _version, header_size, size = _HEADER.unpack_from(blob, pos)
        start, end = pos + header_size, pos + header_size + size
        if header_size < _HEADER.size or end > len(blob):
            raise FatbinError(f"fat binary at offset {pos} claims {size} bytes past the end of the section")
        containers += 1
        e = start
        while e + _ARCH_OFFSET + 4 <= end:
            kind, _ev, entry_header, payload = _ENTRY.unpack_from(blob, e)
            if entry_header == 0:
                break
            (arch,) = struct.unpack_from("<I", blob, e + _ARCH_OFFSET)
            entries += 1
            if kind == KIND_CUBIN:
                sass.add(capability(arch))
            elif kind == KIND_PTX:
                ptx.add(capability(arch))
            else:
                notes.append(f"entry of unknown kind {kind} (arch {arch}) at offset {e}")
            e += entry_header + payload
        pos = max(end, pos + 1)
    return Archs(_sort(sass), _sort(ptx), containers, entries, tuple(notes))


def elf_section(path: Path | str, name: str) -> bytes | None:
    """The bytes of one section of a 64-bit little-endian ELF file, or None when it has none."""
    with open(path, "rb") as fh:
        ident = fh.read(16)
        if ident[:4] != b"\x7fELF":
            raise FatbinError(f"{path} is not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise FatbinError(f"{path} is not a 64-bit little-endian ELF file")
        hdr = fh.read(48)
        shoff = struct.unpack_from("<Q", hdr, 24)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", hdr, 42)
        if shoff == 0 or shnum == 0:
            return None

        def section(i: int) -> tuple[int, int, int]:
            fh.seek(shoff + i * shentsize)
            sh = fh.read(shentsize)
            sh_name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", sh, 0)
            return sh_name, offset, size

        _, str_off, str_size = section(shstrndx)
        fh.seek(str_off)
        names = fh.read(str_size)
        want = name.encode()
        for i in range(shnum):
            sh_name, offset, size = section(i)
            end = names.find(b"\0", sh_name)
            if names[sh_name:end] == want:
                fh.seek(offset)
                return fh.read(size)
    return None


def fatbin_archs(path: Path | str) -> Archs:
    """The architectures an ELF shared object carries (empty when it has no device code)."""
    blob = elf_section(path, ".nv_fatbin")
    if blob is None:
        return Archs()
    return parse_fatbin(blob)


def module_archs(files: list[str]) -> dict[str, dict[str, object]]:
    """fatbin_archs of each file that has device code, keyed by its real path."""
    out: dict[str, dict[str, object]] = {}
    for f in files:
        real = os.path.realpath(f)
        try:
            a = fatbin_archs(real)
        except (OSError, FatbinError) as exc:
            out[real] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        if a.entries:
            out[real] = a.as_dict()
    return out
