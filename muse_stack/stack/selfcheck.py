"""Check the Python environment this process runs in against a lock and its wheel set.

Run at the end of every image build (the build fails on any difference), by `make image-test`
inside the cpu image, and on any machine with `muse-stack stack selfcheck TARGET`:

- every package of the wheel set is installed at the set's version, and (in an image) nothing
  else is, apart from the venv's own pip/setuptools, muse-stack and the packages compiled in
  the image from the set's sdists;
- every component imports, and reports the locked version: torch, Transformer Engine (core and
  PyTorch extension), cuDNN and NCCL *as the loaded libraries report them* (cudnnGetVersion,
  ncclGetVersion; not torch's view, which is the version torch was compiled against),
  flash-attn, DeepEP, megatron-core and Python.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import platform
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from muse_stack.stack import pylock
from muse_stack.stack.lock import LoadedLock, Null, TransformerEngine
from muse_stack.stack.wheelset import check as check_set
from muse_stack.stack.wheelset import sdist_packages

# present in any venv (bootstrap) and the project itself: not part of the resolved set
ALWAYS_EXTRA = {"pip", "setuptools", "muse-stack"}


@dataclass
class Item:
    what: str
    want: str
    got: str
    ok: bool
    note: str = ""


def _installed() -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name and pylock.canonical(name) not in out:  # first on sys.path wins, as for imports
            out[pylock.canonical(name)] = dist.version
    return out


def _same_version(want: str, got: str) -> bool:
    """Equal, or equal up to a local build tag (torch '2.14.1+cu130' for '2.14.1')."""
    return got == want or got.split("+")[0] == want.split("+")[0] and ("+" not in want or got == want)


def _lib_dir(package: str) -> Path | None:
    """nvidia.<package>'s lib folder, where the pip wheels keep the shared libraries."""
    try:
        mod = importlib.import_module(f"nvidia.{package}")
    except ImportError:
        return None
    for base in list(getattr(mod, "__path__", [])):
        lib = Path(base) / "lib"
        if lib.is_dir():
            return lib
    return None


def _mapped(prefix: str) -> list[str]:
    """Distinct files named <prefix>*.so* mapped into this process (/proc/self/maps)."""
    from muse_stack.fingerprint.procmaps import loaded_shared_objects

    try:
        loaded = loaded_shared_objects()
    except OSError:
        return []
    return sorted({os.path.realpath(p) for p in loaded if os.path.basename(p).startswith(prefix)})


def _loaded_version(package: str, soname: str, symbol: str, decode) -> tuple[str | None, str]:
    """The version the library *mapped in this process* reports, and where it is mapped from.

    Importing torch and Transformer Engine loads the library (TE looks in CUDNN_HOME, CUDNN_PATH,
    CUDA_HOME and /usr/local/cuda before the wheels, so a toolkit copy can win); only when nothing
    has mapped it yet is the wheel's own copy opened here. Two different copies mapped at once is a
    failure whatever their versions.
    """
    stem = soname.split(".so")[0]
    family = _mapped(stem)  # libcudnn.so.9 and its sub-libraries libcudnn_graph.so.9, ...
    dirs = sorted({os.path.dirname(p) for p in family})
    if len(dirs) > 1:
        # cuDNN 9's libcudnn.so.9 is a shim that dlopens its sub-libraries by soname: a second
        # cuDNN on the loader's path (an apt one in /usr/lib) supplies them and its version wins
        return None, f"{stem} libraries mapped from {len(dirs)} folders: " + ", ".join(family)
    mapped = [p for p in family if os.path.basename(p).split(".so")[0] == stem]
    if len(mapped) > 1:
        return None, "two copies loaded in one process: " + ", ".join(mapped)
    if mapped:
        path = mapped[0]
    else:
        lib = _lib_dir(package)
        candidates = sorted(glob.glob(str(lib / soname))) if lib else []
        if not candidates:
            return None, f"no {soname} under nvidia/{package}/lib and none loaded"
        path = candidates[0]
    handle = ctypes.CDLL(path)
    if symbol == "ncclGetVersion":
        v = ctypes.c_int()
        rc = handle.ncclGetVersion(ctypes.byref(v))
        if rc != 0:
            return None, f"ncclGetVersion returned {rc}"
        return decode(v.value), path
    fn = getattr(handle, symbol)
    fn.restype = ctypes.c_size_t
    got = decode(int(fn()))
    lib = _lib_dir(package)
    if lib is not None and not path.startswith(str(lib.resolve())):
        return got, f"{path} (not the wheel set's copy under {lib})"
    return got, path


def _cudnn(v: int) -> str:
    # cuDNN 9: major*10000 + minor*100 + patch
    return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"


def _nccl(v: int) -> str:
    # NCCL >= 2.9: major*10000 + minor*100 + patch
    return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"


def _import_version(module: str, attr_path: str = "__version__") -> tuple[str | None, str]:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an import that fails is the finding, whatever the exception
        return None, f"import {module} failed: {type(exc).__name__}: {exc}"
    obj: Any = mod
    for part in attr_path.split("."):
        obj = getattr(obj, part, None)
    return (str(obj) if obj is not None else None), getattr(mod, "__file__", "") or ""


def _te_torch_extension() -> tuple[str | None, str]:
    """Load TE's PyTorch extension the way TE does (its loader checks the metapackage, core and
    extension versions agree); needs no GPU."""
    try:
        from transformer_engine.common import load_framework_extension

        load_framework_extension("torch")
        mod = sys.modules["transformer_engine_torch"]
    except Exception as exc:  # the failure is the finding
        return None, f"{type(exc).__name__}: {exc}"
    return "loads", getattr(mod, "__file__", "") or ""


def components(loaded: LoadedLock, installed: dict[str, str]) -> list[Item]:
    lock = loaded.lock
    c = lock.components
    items = [Item("python", lock.python.version, platform.python_version(),
                  platform.python_version() == lock.python.version)]
    got, where = _import_version("torch")
    items.append(Item("torch (import)", c.torch.version, got or "-",
                      got is not None and _same_version(c.torch.version, got), where))
    te = c.transformer_engine
    if isinstance(te, TransformerEngine):
        got, where = _import_version("transformer_engine")
        items.append(Item("transformer_engine (import)", te.version, got or "-",
                          got is not None and got.split("+")[0] == te.version, where))
        if te.build == "wheel":
            dist = installed.get(pylock.canonical(te.torch_package))
            items.append(Item(f"{te.torch_package} (compiled here)", te.version, dist or "-", dist == te.version))
            got, where = _te_torch_extension()
            items.append(Item("TE PyTorch extension (loaded by TE)", "loads", "loads" if got else "-",
                              got is not None, where))
    if not isinstance(c.cudnn, Null):
        got, where = _loaded_version("cudnn", "libcudnn.so.*", "cudnnGetVersion", _cudnn)
        want = ".".join(c.cudnn.version.split(".")[:3])
        items.append(Item("cuDNN (cudnnGetVersion of the loaded library)", want, got or "-",
                          got == want and "not the wheel set" not in where, where))
    if not isinstance(c.nccl, Null):
        got, where = _loaded_version("nccl", "libnccl.so.*", "ncclGetVersion", _nccl)
        items.append(Item("NCCL (ncclGetVersion of the loaded library)", c.nccl.version, got or "-",
                          got == c.nccl.version, where))
    if not isinstance(c.flash_attn, Null):
        got, where = _import_version("flash_attn")
        items.append(Item("flash_attn (import)", c.flash_attn.version, got or "-", got == c.flash_attn.version, where))
    if not isinstance(c.deepep, Null):
        mod, where = _import_version("deep_ep", "__name__")
        dist = installed.get(pylock.canonical(c.deepep.package))
        items.append(Item(f"deep_ep (import; {c.deepep.package})", c.deepep.version,
                          dist if mod else "-", mod is not None and dist == c.deepep.version, where))
    if not isinstance(c.megatron_core, Null):
        got, where = _import_version("megatron.core", "package_info.__version__")
        items.append(Item("megatron.core (import)", c.megatron_core.version, got or "-",
                          got == c.megatron_core.version, where))
    return items


def wheel_set(loaded: LoadedLock, installed: dict[str, str], *, image: bool) -> tuple[list[Item], list[str]]:
    res = check_set(loaded)
    items = [Item("wheel set matches the lock", "ok", "ok" if res.ok else "; ".join(res.problems), res.ok)]
    for key, pkg in sorted(res.packages.items()):
        got = installed.get(key)
        items.append(Item(f"{pkg.name}", pkg.version, got or "-", got is not None and _same_version(pkg.version, got)))
    extra = sorted(set(installed) - set(res.packages) - ALWAYS_EXTRA - set(sdist_packages(loaded)))
    te = loaded.lock.components.transformer_engine
    if isinstance(te, TransformerEngine) and te.build == "source":
        extra = [e for e in extra if not e.startswith("transformer-engine")]
    if image and extra:
        items.append(Item("nothing installed outside the set", "none", ", ".join(extra), False))
    return items, extra


def run(loaded: LoadedLock, *, image: bool) -> dict[str, Any]:
    installed = _installed()
    set_items, extra = wheel_set(loaded, installed, image=image)
    comp_items = components(loaded, installed)
    bad = [i for i in set_items + comp_items if not i.ok]
    return {
        "lock": loaded.name,
        "lock_sha256": loaded.sha256,
        "python": sys.executable,
        "sys_path_first": [p for p in sys.path if p][:4],
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
        "components": [asdict(i) for i in comp_items],
        "wheel_set": [asdict(i) for i in set_items],
        "outside_set": extra,
        "ok": not bad,
        "problems": [f"{i.what}: want {i.want}, got {i.got}" for i in bad],
    }
