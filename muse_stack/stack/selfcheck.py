"""Check the Python environment this process runs in against a lock and its wheel set.

Run at the end of every image build (the build fails on any difference), by `make image-test`
inside the cpu image, and on any machine with `muse-stack stack selfcheck TARGET`:

- every package of the wheel set is installed at the set's version, and (in an image) nothing
  else is, apart from the venv's own pip/setuptools, muse-stack and the packages compiled in
  the image from the set's sdists;
- every component imports, and reports the locked version: torch, Transformer Engine (core and
  PyTorch extension, loaded by TE's own loader whether it came from the sdist or a source build),
  cuDNN and NCCL *as the loaded libraries report them* (cudnnGetVersion, ncclGetVersion; not
  torch's view, which is the version torch was compiled against) and loaded from the wheel set's
  folder, flash-attn, DeepEP, megatron-core and Python;
- the machine code DeepEP's and flash-attn's extensions carry (the architectures of their
  .nv_fatbin, muse_stack.fingerprint.fatbin) is exactly the lock's list.
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


def in_family(basename: str, stem: str) -> bool:
    """libcudnn.so.9 and its sub-libraries libcudnn_graph.so.9, ... are the family of "libcudnn";
    libnccl-net-ofi.so (a network plugin) is not of "libnccl"'s."""
    name = basename.split(".so")[0]
    return name == stem or name.startswith(stem + "_")


def _mapped(stem: str) -> list[str]:
    """Distinct files of the library family `stem` mapped into this process (/proc/self/maps)."""
    from muse_stack.fingerprint.procmaps import loaded_shared_objects

    try:
        loaded = loaded_shared_objects()
    except OSError:
        return []
    return sorted({os.path.realpath(p) for p in loaded if in_family(os.path.basename(p), stem)})


# cuDNN 9's libcudnn.so.9 is a shim: each sub-library is opened by soname the first time one of its
# functions is called. The version checks below need no GPU and make the shim open each of them
# through its own loader path, so the folder check sees every sub-library the process would use.
CUDNN_SUBLIBRARY_CALLS = ("cudnnGraphVersionCheck", "cudnnOpsVersionCheck", "cudnnCnnVersionCheck",
                          "cudnnAdvVersionCheck")


def _map_sublibraries(handle: ctypes.CDLL, package: str, stem: str) -> list[str]:
    """Make the shim open its sub-libraries; returns what was done (for the report)."""
    done = []
    for name in CUDNN_SUBLIBRARY_CALLS:
        fn = getattr(handle, name, None)
        if fn is None:
            continue
        fn.restype = ctypes.c_int
        fn()
        done.append(name)
    if not done:
        # no forwarding entry points: open each sub-library of the wheel by soname, as the shim would
        lib = _lib_dir(package)
        for f in sorted(glob.glob(str(lib / f"{stem}_*.so.*"))) if lib else []:
            try:
                ctypes.CDLL(os.path.basename(f))
                done.append(os.path.basename(f))
            except OSError:
                pass
    return done


def _loaded_version(package: str, soname: str, symbol: str, decode) -> tuple[str | None, str]:
    """The version the library *mapped in this process* reports, and where it is mapped from.

    Importing torch and Transformer Engine loads the library (TE looks in CUDNN_HOME, CUDNN_PATH,
    CUDA_HOME and /usr/local/cuda before the wheels, so a toolkit copy can win); only when nothing
    has mapped it yet is the wheel's own copy opened here. Two different copies mapped at once is a
    failure whatever their versions.
    """
    stem = soname.split(".so")[0]

    def mixed(family: list[str]) -> str | None:
        dirs = sorted({os.path.dirname(p) for p in family})
        if len(dirs) > 1:
            # a second copy on the loader's path (an apt one in /usr/lib/<triplet>) supplies part of
            # the family (cuDNN 9's shim opens its sub-libraries by soname), and its version wins there
            return f"{stem} libraries mapped from {len(dirs)} folders: " + ", ".join(family)
        return None

    family = _mapped(stem)
    if mixed(family):  # already mixed by what this process loaded before
        return None, mixed(family)  # type: ignore[return-value]
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
        got = decode(v.value)
    else:
        fn = getattr(handle, symbol)
        fn.restype = ctypes.c_size_t
        got = decode(int(fn()))
        if stem == "libcudnn":
            _map_sublibraries(handle, package, stem)
    # only now, with the sub-libraries mapped, is the family complete
    problem = mixed(_mapped(stem))
    if problem:
        return None, problem
    lib = _lib_dir(package)
    if lib is not None and not os.path.realpath(path).startswith(str(lib.resolve())):
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


def _extension_file(modules: tuple[str, ...], package: str) -> str | None:
    """The shared object of an imported extension module (the first of `modules` that is loaded),
    else the first extension file in the package's folder."""
    for name in modules:
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None) if mod else None
        if f and ".so" in os.path.basename(f):
            return f
    try:
        pkg = importlib.import_module(package)
    except Exception:  # the import's failure is reported by the import item
        return None
    for base in list(getattr(pkg, "__path__", [])):
        found = sorted(glob.glob(os.path.join(base, "*.so")))
        if found:
            return found[0]
    return None


def device_code_item(what: str, want: list[str], file: str | None) -> Item:
    """The architectures of a loaded extension's machine code (.nv_fatbin) against the lock's list."""
    from muse_stack.fingerprint.fatbin import FatbinError, fatbin_archs

    want_text = ";".join(want)
    if file is None:
        return Item(what, want_text, "-", False, "no extension module found")
    try:
        archs = fatbin_archs(file)
    except (OSError, FatbinError) as exc:
        return Item(what, want_text, "-", False, f"{file}: {exc}")
    got = ";".join(archs.sass) or "none"
    note = file + (f" (PTX {';'.join(archs.ptx)})" if archs.ptx else "")
    return Item(what, want_text, got, list(archs.sass) == list(want), note)


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


def library_item(what: str, want: str, got: str | None, where: str) -> Item:
    """A loaded CUDA library: the locked version, and the wheel set's own copy (not one that merely
    reports the same version from a system folder)."""
    return Item(what, want, got or "-", got == want and "not the wheel set" not in where, where)


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
        # the extension TE's loader finds, from the sdist build or from the source build alike
        got, where = _te_torch_extension()
        items.append(Item(f"TE PyTorch extension (loaded by TE; {te.build} build)", "loads", "loads" if got else "-",
                          got is not None, where))
    if not isinstance(c.cudnn, Null):
        want = ".".join(c.cudnn.version.split(".")[:3])
        items.append(library_item("cuDNN (cudnnGetVersion of the loaded library)", want,
                                  *_loaded_version("cudnn", "libcudnn.so.*", "cudnnGetVersion", _cudnn)))
    if not isinstance(c.nccl, Null):
        items.append(library_item("NCCL (ncclGetVersion of the loaded library)", c.nccl.version,
                                  *_loaded_version("nccl", "libnccl.so.*", "ncclGetVersion", _nccl)))
    if not isinstance(c.flash_attn, Null):
        got, where = _import_version("flash_attn")
        items.append(Item("flash_attn (import)", c.flash_attn.version, got or "-", got == c.flash_attn.version, where))
        if got is not None:
            items.append(device_code_item("flash-attn machine code (.nv_fatbin of flash_attn_2_cuda)",
                                          c.flash_attn.cuda_archs, _extension_file(("flash_attn_2_cuda",), "flash_attn")))
    if not isinstance(c.deepep, Null):
        mod, where = _import_version("deep_ep", "__name__")
        dist = installed.get(pylock.canonical(c.deepep.package))
        items.append(Item(f"deep_ep (import; {c.deepep.package})", c.deepep.version,
                          dist if mod else "-", mod is not None and dist == c.deepep.version, where))
        items.append(device_code_item("DeepEP machine code (.nv_fatbin of deep_ep's extension)",
                                      c.deepep.cuda_archs, _extension_file(("deep_ep._C", "deep_ep_cpp"), "deep_ep")))
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
