"""CUDA libraries as this process loaded them (paths and hashes from /proc/self/maps).

CUDA, cuBLAS, cuDNN and NCCL are initialised first (a small matmul, a small convolution,
the NCCL version call) so the lazily loaded parts are mapped; then each library's version
is asked of the loaded file itself through ctypes, next to what torch reports.

``device_code`` records the GPU architectures of the loaded extension modules of the stack's
kernels (DeepEP, flash-attn, Transformer Engine) as their .nv_fatbin states them
(muse_stack.fingerprint.fatbin): the machine code a run could execute, not the build's intent.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from muse_stack.fingerprint import fatbin, hashing, procmaps
from muse_stack.fingerprint.absent import absent, guarded
from muse_stack.fingerprint.gpu import cuda_version_text

# name -> file-name pattern of the shared objects that make it up
LIBRARIES: dict[str, str] = {
    "cuda_runtime": r"^libcudart\.so",
    "cublas": r"^libcublas(Lt)?\.so",
    "cudnn": r"^libcudnn(_[a-z_]+)?\.so",
    "nccl": r"^libnccl\.so",
    "driver": r"^libcuda\.so",
    "nvrtc": r"^libnvrtc(-builtins)?\.so",
    "nvjitlink": r"^libnvJitLink\.so",
    "nvshmem": r"^libnvshmem",
}


def decode_cudnn(encoded: int) -> str:
    """cuDNN >= 9 encodes major*10000 + minor*100 + patch; cuDNN <= 8 major*1000 + minor*100 + patch."""
    if encoded >= 90000:
        return f"{encoded // 10000}.{(encoded % 10000) // 100}.{encoded % 100}"
    return f"{encoded // 1000}.{(encoded % 1000) // 100}.{encoded % 100}"


def decode_nccl(encoded: int) -> str:
    """NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older major*1000 + minor*100 + patch."""
    if encoded >= 20900:
        return f"{encoded // 10000}.{(encoded % 10000) // 100}.{encoded % 100}"
    return f"{encoded // 1000}.{(encoded % 1000) // 100}.{encoded % 100}"


def nccl_tuple_text(value: Any) -> str:
    """torch.cuda.nccl.version() returns (major, minor, patch[, suffix]) or, in old torch, an int."""
    if isinstance(value, int):
        return decode_nccl(value)
    parts = [str(p) for p in value[:3]]
    text = ".".join(parts)
    if len(value) > 3 and value[3]:
        text += str(value[3])
    return text


def _int_out(path: str, symbol: str, *args: int) -> int:
    lib = ctypes.CDLL(path)  # already mapped: dlopen returns the loaded copy
    fn = getattr(lib, symbol)
    out = ctypes.c_int()
    status = fn(*[ctypes.c_int(a) for a in args], ctypes.byref(out))
    if status != 0:
        raise RuntimeError(f"{symbol} returned status {status}")
    return out.value


def _cudnn_loaded_version(path: str) -> int:
    lib = ctypes.CDLL(path)
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    return int(lib.cudnnGetVersion())


def _cublas_loaded_version(path: str) -> str:
    # libraryPropertyType: MAJOR_VERSION=0, MINOR_VERSION=1, PATCH_LEVEL=2
    return ".".join(str(_int_out(path, "cublasGetProperty", t)) for t in (0, 1, 2))


def _torch_cudnn_refusal(torch: Any) -> str | None:
    """Why torch's cuDNN backend will not run with the loaded cuDNN, or None when it will."""
    if not torch.backends.cudnn.is_available():
        return None
    try:
        torch.backends.cudnn.version()
    except RuntimeError as exc:  # "PyTorch was compiled against (9, 24, 0) but found runtime version (9, 22, 0)"
        return f"torch's cuDNN backend refuses the loaded library ({exc})"
    return None


def initialise(torch: Any) -> list[str]:
    """Bring up CUDA, cuBLAS, cuDNN and NCCL on this process's device; returns what was done.

    If CUDA is not yet initialised and LOCAL_RANK is set, the device is chosen as LOCAL_RANK
    (what the launcher would do) so that all ranks do not open a context on GPU 0.
    """
    done = []
    if not torch.cuda.is_initialized():
        local = os.environ.get("LOCAL_RANK", "")
        if local.isdigit() and torch.cuda.device_count() > 0:
            torch.cuda.set_device(int(local) % torch.cuda.device_count())
            done.append(f"set device {int(local) % torch.cuda.device_count()} from LOCAL_RANK")
    torch.cuda.init()
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.ones((16, 16), device=device)
    _ = (a @ a).sum().item()
    b = a.to(torch.bfloat16)
    _ = (b @ b).float().sum().item()
    done.append("cuBLAS matmul (fp32, bf16)")
    refused = _torch_cudnn_refusal(torch)
    if refused:
        # a deliberate pairing (the b200 lock's cuDNN 9.22 under torch built for 9.24): torch's own
        # cuDNN backend refuses it, so it is not initialised here; the loaded library's version is
        # still read below with cudnnGetVersion
        done.append(f"cuDNN convolution skipped: {refused}")
    elif torch.backends.cudnn.is_available():
        x = torch.ones((1, 1, 8, 8), device=device)
        w = torch.ones((1, 1, 3, 3), device=device)
        with torch.backends.cudnn.flags(enabled=True):
            _ = torch.nn.functional.conv2d(x, w).sum().item()
        done.append("cuDNN convolution")
    try:
        torch.cuda.nccl.version()
        done.append("NCCL version query")
    except Exception as exc:
        done.append(f"NCCL version query failed: {exc}")
    torch.cuda.synchronize(device)
    return done


# loaded extension modules whose machine code is recorded: DeepEP, flash-attn, Transformer Engine
DEVICE_CODE = r"(^|/)(deep_ep/_C\.|deep_ep_cpp|flash_attn_2_cuda|transformer_engine_torch|libtransformer_engine)[^/]*\.so"


def device_code(loaded: list[str]) -> dict[str, Any]:
    """The .nv_fatbin architectures of each loaded DeepEP, flash-attn and TE extension module."""
    import re

    files = sorted({p for p in loaded if re.search(DEVICE_CODE, p)})
    if not files:
        return absent("no DeepEP, flash-attn or Transformer Engine extension module is mapped in this process")
    return fatbin.module_archs(files)


def _multiple_copies(paths: list[str]) -> list[str]:
    """Library names (up to ".so") mapped from more than one distinct file."""
    by_stem: dict[str, set[str]] = {}
    for p in paths:
        by_stem.setdefault(os.path.basename(p).split(".so")[0], set()).add(os.path.realpath(p))
    return sorted(stem for stem, files in by_stem.items() if len(files) > 1)


def _files(paths: list[str]) -> dict[str, Any]:
    records = hashing.file_records(paths)
    out: dict[str, Any] = {}
    for path, rec in records.items():
        key = os.path.basename(path)
        n = 2
        while key in out:
            key = f"{os.path.basename(path)}#{n}"
            n += 1
        out[key] = rec
    return out


def collect(torch: Any) -> dict[str, Any]:
    if torch is None:
        return absent("torch not installed: CUDA libraries are read from the torch process")
    if torch.version.cuda is None:
        return absent(f"CUDA not available: torch {torch.__version__} is a CPU build (torch.version.cuda is None)")
    if not torch.cuda.is_available():
        return absent(
            f"CUDA not available: torch.cuda.is_available() is False (torch {torch.__version__}, "
            "no usable NVIDIA driver or device)"
        )
    init = guarded("initialising CUDA", lambda: initialise(torch))
    loaded = procmaps.loaded_shared_objects()
    section: dict[str, Any] = {"initialised": init}
    for name, pattern in LIBRARIES.items():
        paths = procmaps.find_loaded(loaded, pattern)
        entry: dict[str, Any] = {}
        if paths:
            entry["files"] = _files(paths)
            copies = _multiple_copies(paths)
            if copies:
                entry["multiple_copies_loaded"] = copies
            folders = sorted({os.path.dirname(os.path.realpath(p)) for p in paths})
            if len(folders) > 1:
                # e.g. the wheel's libcudnn.so.9 shim with an apt cuDNN's sub-libraries: two versions at once
                entry["mixed_folders"] = folders
        else:
            entry["files"] = absent(f"no {pattern} mapped in /proc/self/maps (not loaded, or linked statically)")
        first = paths[0] if paths else None
        main = next((p for p in paths if os.path.basename(p).startswith(("libcudnn.so", "libcublas.so"))), first)
        if name == "cuda_runtime":
            entry["torch_build"] = torch.version.cuda
            entry["version"] = (
                guarded("cudaRuntimeGetVersion", lambda: cuda_version_text(_int_out(first, "cudaRuntimeGetVersion")))
                if first
                else absent("libcudart not loaded as a shared object (statically linked); torch_build is the build version")
            )
        elif name == "driver":
            entry["version"] = (
                guarded("cuDriverGetVersion", lambda: cuda_version_text(_int_out(first, "cuDriverGetVersion")))
                if first
                else absent("libcuda not loaded")
            )
        elif name == "cublas":
            entry["version"] = (
                guarded("cublasGetProperty", lambda: _cublas_loaded_version(main)) if main else absent("libcublas not loaded")
            )
        elif name == "cudnn":
            reported = guarded("torch.backends.cudnn.version()", torch.backends.cudnn.version)
            entry["torch_reports"] = reported
            loaded_int = guarded("cudnnGetVersion", lambda: _cudnn_loaded_version(main)) if main else None
            encoded = loaded_int if isinstance(loaded_int, int) else reported
            entry["encoded"] = encoded if isinstance(encoded, int) else absent("cuDNN version not readable")
            entry["version"] = decode_cudnn(encoded) if isinstance(encoded, int) else absent(
                "cuDNN not loaded and torch reports no cuDNN"
            )
        elif name == "nccl":
            reported = guarded("torch.cuda.nccl.version()", lambda: nccl_tuple_text(torch.cuda.nccl.version()))
            entry["torch_reports"] = reported
            loaded_v = guarded("ncclGetVersion", lambda: decode_nccl(_int_out(first, "ncclGetVersion"))) if first else None
            if isinstance(loaded_v, str):
                entry["version"] = loaded_v
            elif isinstance(reported, str):
                entry["version"] = reported
                entry["note"] = "libnccl not mapped as a shared object; version as torch reports it (statically linked)"
            else:
                entry["version"] = absent("NCCL version not readable")
        if name in ("nvrtc", "nvjitlink", "nvshmem") and not paths:
            continue  # optional libraries: only recorded when loaded
        section[name] = entry
    section["device_code"] = guarded("reading the extensions' .nv_fatbin", lambda: device_code(loaded))
    return section
