"""Training frameworks: versions, build facts and hashes of their compiled libraries.

A version string does not identify a build: the same Transformer Engine rebuilt for other
GPU architectures keeps its version. So every framework also records the sha256 of each
shared object its distribution installed (marked ``loaded`` when this process mapped it),
plus one combined hash over them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

from muse_stack.fingerprint import hashing, procmaps
from muse_stack.fingerprint.absent import absent, guarded
from muse_stack.fingerprint.identity import git_checkout
from muse_stack.fingerprint.pyenv import normalize

# section key -> (distribution names, importable module)
FRAMEWORKS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch",), "torch"),
    "transformer_engine": (
        ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12", "transformer-engine-cu13"),
        "transformer_engine",
    ),
    "megatron_core": (("megatron-core",), "megatron.core"),
    "flash_attn": (("flash-attn",), "flash_attn"),
    "deepep": (("deep-ep", "sgl-deep-ep", "deepep"), "deep_ep"),
    "triton": (("triton", "pytorch-triton"), "triton"),
}


def module_dir(module: str) -> Path | None:
    """Directory of an importable package, found without importing it (or its parent)."""
    loaded = sys.modules.get(module)
    if loaded is not None and getattr(loaded, "__file__", None):
        return Path(loaded.__file__).resolve().parent
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        candidate = Path(root).joinpath(*rest.split(".")) if rest else Path(root)
        if candidate.is_dir():
            return candidate.resolve()
    return None


def _git_for(package_dir: Path) -> Any:
    for parent in [package_dir, *list(package_dir.parents)[:3]]:
        if parent.name in ("site-packages", "dist-packages"):
            return None
        checkout = git_checkout(parent)
        if checkout is not None:
            return {"root": str(parent), **checkout} if "commit" in checkout else checkout
    return None


def installed_shared_objects(index: dict[str, metadata.Distribution]) -> list[str]:
    """Shared objects the framework distributions installed (known before importing them)."""
    out = []
    for dist_names, _module in FRAMEWORKS.values():
        for name in dist_names:
            dist = index.get(normalize(name))
            for entry in (dist.files or []) if dist is not None else []:
                if hashing.is_shared_object(str(entry)):
                    out.append(str(Path(dist.locate_file(entry))))
    return out


def _compiled_files(dists: list[metadata.Distribution], package_dir: Path | None, loaded: list[str]) -> dict[str, Any]:
    """{relative name: {path, size, sha256, loaded}} for the shared objects of a framework."""
    found: dict[str, str] = {}  # absolute path -> relative name
    for dist in dists:
        for entry in dist.files or []:
            if hashing.is_shared_object(str(entry)):
                found.setdefault(str(Path(dist.locate_file(entry)).resolve()), str(entry))
    if package_dir is not None:
        base = package_dir.parent
        for path in procmaps.loaded_under(loaded, package_dir):
            real = os.path.realpath(path)
            found.setdefault(real, os.path.relpath(real, base))
        if not dists:  # a source checkout on PYTHONPATH: its built extensions
            for path in sorted(package_dir.rglob("*.so*")):
                if hashing.is_shared_object(path) and path.is_file():
                    found.setdefault(str(path.resolve()), os.path.relpath(path, base))
    loaded_real = {os.path.realpath(p) for p in loaded}
    records = hashing.file_records([p for p in found if os.path.exists(p)])
    out: dict[str, Any] = {}
    for path, rel in sorted(found.items(), key=lambda kv: kv[1]):
        rec = records.get(path)
        if rec is None:
            out[rel] = {"path": path, "sha256": absent("listed in the distribution RECORD but missing on disk")}
            continue
        out[rel] = {**rec, "loaded": path in loaded_real}
    return out


def _megatron_version_from_source(package_dir: Path) -> Any:
    info = package_dir / "package_info.py"
    if not info.exists():
        return absent(f"{info} not found")
    text = info.read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
        m = re.search(rf"^{key}\s*=\s*['\"]?([\w.]*)['\"]?", text, re.M)
        parts[key] = m.group(1) if m else ""
    if not parts["MAJOR"]:
        return absent(f"{info} has no MAJOR")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


def _torch_facts(torch: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        facts: dict[str, Any] = {
            "module_version": torch.__version__,
            "git_version": torch.version.git_version,
            "cuda_build": torch.version.cuda or absent("CPU build of torch (torch.version.cuda is None)"),
            "hip_build": getattr(torch.version, "hip", None) or absent("not a ROCm build"),
            "arch_list": torch.cuda.get_arch_list(),
            "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
            "debug": bool(torch.version.debug),
            "settings": {
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "cudnn_enabled": bool(torch.backends.cudnn.enabled),
                "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
                "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
                "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                "matmul_allow_fp16_reduced_precision": bool(
                    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
                ),
                "matmul_allow_bf16_reduced_precision": bool(
                    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
                ),
                "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "num_threads": torch.get_num_threads(),
                # the instruction set of ATen's CPU kernels (AVX512, AVX2, ... or ATEN_CPU_CAPABILITY's
                # choice): their reductions sum in vector-width order, so two CPUs that differ here give
                # losses that part in the last bits at step 1 (benchmarks/results/demo-tiny-cpu)
                "cpu_capability": _cpu_capability(torch),
            },
        }
    return facts


def _cpu_capability(torch: Any) -> Any:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError) as exc:  # a torch without the query
        return absent(f"torch.backends.cpu.get_cpu_capability: {type(exc).__name__}: {exc}")


def _maybe_import(module: str, cuda_ok: bool) -> tuple[Any, Any]:
    """(module or None, note) — imports Transformer Engine only where CUDA works (it dlopens libcuda)."""
    if module in sys.modules:
        return sys.modules[module], True
    if not cuda_ok:
        return None, absent("not imported: CUDA not available (it loads libcuda at import)")
    try:
        return importlib.import_module(module), True
    except Exception as exc:
        return None, absent(f"import {module} failed: {type(exc).__name__}: {exc}")


def collect_one(
    key: str,
    index: dict[str, metadata.Distribution],
    loaded: list[str],
    torch: Any,
    cuda_ok: bool,
) -> Any:
    dist_names, module = FRAMEWORKS[key]
    dists = [index[normalize(n)] for n in dist_names if normalize(n) in index]
    package_dir = module_dir(module)
    if not dists and package_dir is None:
        return absent(f"not installed (no distribution {', '.join(dist_names)} and no importable {module})")
    entry: dict[str, Any] = {}
    if dists:
        entry["distributions"] = {d.metadata["Name"]: d.version for d in dists}
        entry["version"] = dists[0].version
    entry["location"] = str(package_dir) if package_dir else absent(f"module {module} not found on sys.path")
    if key == "torch" and torch is not None:
        entry.update(guarded("reading torch build facts", lambda: _torch_facts(torch)))
    if key == "transformer_engine":
        te, imported = _maybe_import("transformer_engine", cuda_ok)
        entry["imported"] = imported
        if te is not None:
            entry["module_version"] = getattr(te, "__version__", absent("transformer_engine has no __version__"))
            loaded = procmaps.loaded_shared_objects()  # importing TE maps its core library
        core = procmaps.find_loaded(loaded, r"^libtransformer_engine\.so")
        entry["core_library"] = (
            hashing.file_record(core[0]) if core else absent("libtransformer_engine.so not mapped in this process")
        )
    if key == "megatron_core" and package_dir is not None:
        source_version = _megatron_version_from_source(package_dir)
        entry["source_version"] = source_version
        if "version" not in entry and isinstance(source_version, str):
            entry["version"] = source_version
    if key in ("triton", "flash_attn", "deepep") and module in sys.modules:
        entry["module_version"] = getattr(sys.modules[module], "__version__", None)
    if "version" not in entry:
        entry["version"] = absent(f"{module} found at {package_dir} without distribution metadata")
    if package_dir is not None:
        git = _git_for(package_dir)
        if git is not None:
            entry["git"] = git
    files = _compiled_files(dists, package_dir, loaded)
    entry["compiled_libraries"] = files or absent("no compiled libraries (pure Python)")
    if files:
        entry["compiled_libraries_sha256"] = hashing.combined_sha256(files)
    return entry


def collect(index: dict[str, metadata.Distribution], torch: Any, cuda_ok: bool) -> dict[str, Any]:
    loaded = procmaps.loaded_shared_objects()
    return {
        key: guarded(f"probing {key}", lambda key=key: collect_one(key, index, loaded, torch, cuda_ok))
        for key in FRAMEWORKS
    }
