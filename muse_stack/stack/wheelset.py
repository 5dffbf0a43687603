"""The hash-pinned wheel set of a lock: containers/locks/pylock.<target>.toml (PEP 751).

The lock names the components; the set is what a real resolver (uv) makes of them for the
target's Python and platform, with every transitive dependency pinned to one version and every
file to its sha256. The Dockerfile installs from the set with hashes required, flake.nix fetches
the same files by the same hashes, and `muse-stack stack check` verifies the set against the lock.

    muse-stack stack resolve b200          regenerate one set (make wheelsets: all of them)
    muse-stack stack resolve b200 --check  resolve again and compare with the committed set

Where the record deliberately differs from a dependency's metadata (cuDNN 9.22.0.52 under torch
2.14.1, which asks for 9.24.0.43) the lock states a named ``[[overrides]]`` entry; the resolver
applies exactly those, and nothing else may differ from what the metadata asks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from muse_stack.stack import pylock
from muse_stack.stack.lock import LoadedLock, LockError, Null, TransformerEngine

# installed before the packages that are compiled in the image (pip --no-build-isolation):
# setuptools/wheel/packaging for both setup.py files, ninja for parallel compiles, pybind11 for
# Transformer Engine's build_ext, psutil for flash-attn's job count
BUILD_TOOLS = ("setuptools", "wheel", "packaging", "ninja", "pybind11", "psutil")
# Transformer Engine built from a source commit (the gb200 lock) runs CMake for its core library:
# TE's build_tools find the `cmake` wheel's binary first (cmake.CMAKE_BIN_DIR), then PATH
SOURCE_TE_BUILD_TOOLS = ("cmake",)
# the optional extras of muse-stack that every GPU image carries (logging.wandb runs in the image)
GPU_EXTRAS = ("wandb",)

ARCH = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}


def set_path(loaded: LoadedLock) -> Path:
    return loaded.path.parent / f"pylock.{loaded.name}.toml"


def _pyproject() -> dict:
    return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def _project_dependencies() -> list[str]:
    return list(_pyproject()["project"]["dependencies"])


def _build_requires() -> list[str]:
    """muse-stack's own build backend (pyproject [build-system] requires): the image installs the
    source tree without build isolation, from the set's setuptools, never an unpinned download."""
    return list(_pyproject()["build-system"]["requires"])


def _extra_dependencies(extra: str) -> list[str]:
    return list(_pyproject()["project"].get("optional-dependencies", {}).get(extra, []))


def sdist_packages(loaded: LoadedLock) -> list[str]:
    """Packages the image compiles from their sdist (the set pins the sdist's hash)."""
    c = loaded.lock.components
    out = []
    te = c.transformer_engine
    if isinstance(te, TransformerEngine) and te.build == "wheel":
        out.append(te.torch_package)
    if not isinstance(c.flash_attn, Null):
        out.append(c.flash_attn.package)
    return [pylock.canonical(p) for p in out]


def component_pins(loaded: LoadedLock) -> dict[str, str]:
    """package -> version for every component the lock pins through the package registry."""
    lock = loaded.lock
    c = lock.components
    pins = {c.torch.package: c.torch.version}
    te = c.transformer_engine
    if isinstance(te, TransformerEngine) and te.build == "wheel":
        pins[te.core_package] = te.version
        pins[te.torch_package] = te.version
        if te.meta_package:
            pins[te.meta_package] = te.version
    for comp in (c.cudnn, c.nccl, c.flash_attn, c.deepep, c.megatron_core):
        if not isinstance(comp, Null):
            pins[comp.package] = comp.version
    return {pylock.canonical(k): v for k, v in pins.items()}


def requirements(loaded: LoadedLock) -> list[str]:
    """What the resolver is asked for: the lock's components, muse-stack's own dependencies and
    build backend, the GPU images' extras (wandb), the build tools of the compiled packages and,
    for a source-built TE, its runtime needs and CMake."""
    reqs = [f"{k}=={v}" for k, v in component_pins(loaded).items()]
    te = loaded.lock.components.transformer_engine
    if isinstance(te, TransformerEngine) and te.build == "source":
        reqs += te.source_requires
        reqs += list(SOURCE_TE_BUILD_TOOLS)
    reqs += _project_dependencies()
    reqs += _build_requires()
    if loaded.lock.kind == "gpu":
        for extra in GPU_EXTRAS:
            reqs += _extra_dependencies(extra)
        reqs += list(BUILD_TOOLS)
    return reqs


def overrides(loaded: LoadedLock) -> list[str]:
    return [f"{o.package}=={o.version}" for o in loaded.lock.overrides]


def python_platform(loaded: LoadedLock) -> str:
    return f"{ARCH[loaded.lock.platform]}-manylinux_{loaded.lock.resolution.manylinux}"


def inputs(loaded: LoadedLock) -> dict[str, object]:
    r = loaded.lock.resolution
    return {
        "requirements": requirements(loaded),
        "overrides": overrides(loaded),
        "python": loaded.lock.python.version,
        "platform": python_platform(loaded),
        "index_url": r.index_url,
        "find_links": list(r.find_links),
        "exclude_newer": r.exclude_newer,
    }


def inputs_sha256(loaded: LoadedLock) -> str:
    return hashlib.sha256(json.dumps(inputs(loaded), sort_keys=True).encode()).hexdigest()


def uv_binary() -> str:
    try:
        from uv import find_uv_bin  # the `uv` package from PyPI (make setup installs it)

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise LockError(
        "uv is not installed: the wheel sets are resolved with uv",
        field="uv",
        fix="run `make setup` (it installs uv), or `pip install uv`",
        exit_code=2,
    )


class ResolveError(LockError):
    pass


def _uv_compile(loaded: LoadedLock, requirements: list[str]) -> str:
    """uv's pylock.toml for `requirements` with the lock's overrides, Python, platform, index and
    cut-off date (the registry as it answers now, never a stale local cache)."""
    inp = inputs(loaded)
    with tempfile.TemporaryDirectory(prefix="muse-stack-resolve-") as tmp:
        t = Path(tmp)
        (t / "requirements.in").write_text("\n".join(requirements) + "\n")
        (t / "overrides.txt").write_text("\n".join(inp["overrides"]) + "\n")  # type: ignore[arg-type]
        out = t / f"pylock.{loaded.name}.toml"
        cmd = [
            uv_binary(), "pip", "compile", str(t / "requirements.in"),
            "--override", str(t / "overrides.txt"),
            "--python-version", str(inp["python"]),
            "--python-platform", str(inp["platform"]),
            "--index-url", str(inp["index_url"]),
            "--exclude-newer", str(inp["exclude_newer"]),
            "--generate-hashes", "--format", "pylock.toml", "--no-header", "--quiet",
            "--no-config", "--refresh", "-o", str(out),
        ]  # fmt: skip
        # --refresh: the registry as it is now (as of exclude_newer), never a stale local index cache
        for link in inp["find_links"]:  # type: ignore[union-attr]
            cmd += ["--find-links", str(link)]
        env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            msg = proc.stderr.strip() or proc.stdout.strip()
            raise ResolveError(
                f"the {loaded.name} lock does not resolve for Python {inp['python']} on {inp['platform']}:\n{msg}",
                field="components",
                value=loaded.name,
                rule="every pinned version must resolve together on the lock's platform",
                fix="change the pin the resolver names, or state a deliberate difference as an [[overrides]] entry",
                exit_code=1,
            )
        return out.read_text()


def resolve_text(loaded: LoadedLock) -> str:
    """Run the resolver and return the set's text, with the muse-stack header and tool table."""
    inp = inputs(loaded)
    body = _uv_compile(loaded, list(inp["requirements"]))  # type: ignore[arg-type]
    header = (
        f"# The hash-pinned wheel set of containers/locks/{loaded.name}.toml, resolved by uv for\n"
        f"# Python {inp['python']} on {inp['platform']} from {inp['index_url']} as of {inp['exclude_newer']}.\n"
        f"# Generated, not edited: `muse-stack stack resolve {loaded.name}` (or `make wheelsets`).\n"
    )
    tool = (
        "\n[tool.muse-stack]\n"
        f'lock = "{loaded.name}"\n'
        f'inputs-sha256 = "{inputs_sha256(loaded)}"\n'
        f"sdists = {json.dumps(sdist_packages(loaded))}\n"
    )
    return header + body.rstrip("\n") + "\n" + tool


def write(loaded: LoadedLock) -> Path:
    text = resolve_text(loaded)
    dest = set_path(loaded)
    tmp = dest.with_suffix(".toml.tmp")
    tmp.write_text(text)
    os.replace(tmp, dest)
    return dest


@dataclass(frozen=True)
class SetCheck:
    ok: bool
    problems: list[str]
    packages: dict[str, pylock.Package]


def check(loaded: LoadedLock, path: Path | None = None) -> SetCheck:
    """Offline: the committed set belongs to this lock as it is now, pins every component at the
    locked version, applies exactly the declared overrides, and hashes every file."""
    path = path or set_path(loaded)
    try:
        doc, pkgs = pylock.load(path)
    except pylock.PylockError as exc:
        return SetCheck(False, [f"{exc}; generate it with `muse-stack stack resolve {loaded.name}`"], {})
    problems: list[str] = []
    tool = doc.get("tool", {}).get("muse-stack", {})
    if tool.get("lock") != loaded.name:
        problems.append(f"{path.name} was resolved for lock {tool.get('lock')!r}, not {loaded.name!r}")
    if tool.get("inputs-sha256") != inputs_sha256(loaded):
        problems.append(
            f"{path.name} is stale: the lock's components, overrides or resolution settings (or pyproject.toml's "
            f"dependencies) changed since it was resolved; run `muse-stack stack resolve {loaded.name}`"
        )
    for name, version in component_pins(loaded).items():
        got = pkgs.get(name)
        if got is None:
            problems.append(f"{name} is pinned by the lock but absent from the set")
        elif got.version.split("+")[0] != version.split("+")[0] or ("+" in version and got.version != version):
            problems.append(f"{name} is {got.version} in the set, the lock pins {version}")
    for o in loaded.lock.overrides:
        got = pkgs.get(pylock.canonical(o.package))
        if got is None or got.version != o.version:
            problems.append(
                f"override {o.package}=={o.version} is not applied (the set has {got.version if got else 'none'})"
            )
    wanted_sdists = set(sdist_packages(loaded))
    for key, pkg in pkgs.items():
        if key in wanted_sdists:
            if pkg.sdist is None:
                problems.append(f"{pkg.name}: the image builds it from source but the set pins no sdist")
        elif not pkg.wheels:
            problems.append(f"{pkg.name} {pkg.version}: only an sdist; the image installs binaries for everything else")
    return SetCheck(not problems, problems, pkgs)


def differences(committed: dict[str, pylock.Package], fresh: dict[str, pylock.Package]) -> list[str]:
    """What a fresh resolution changes against the committed set: versions and file hashes."""
    out = []
    for key in sorted(set(committed) | set(fresh)):
        a, b = committed.get(key), fresh.get(key)
        if a is None:
            out.append(f"{b.name} {b.version}: new in the fresh resolution")
        elif b is None:
            out.append(f"{a.name} {a.version}: no longer resolved")
        elif a.version != b.version:
            out.append(f"{a.name}: {a.version} committed, {b.version} resolved")
        else:
            ha = {x.sha256 for x in a.wheels} | ({a.sdist.sha256} if a.sdist else set())
            hb = {x.sha256 for x in b.wheels} | ({b.sdist.sha256} if b.sdist else set())
            if ha != hb:
                out.append(f"{a.name} {a.version}: the registry's files differ from the committed hashes")
    return out


def served_as_committed(committed: dict[str, pylock.Package], fresh: dict[str, pylock.Package]) -> list[str]:
    """What the committed set promises and the registry no longer keeps: the same packages at the
    same versions, and every committed file served with its committed hash. A file the registry
    added to a release since (a new platform's wheel) breaks no promise and is not listed."""
    out = []
    for key in sorted(set(committed) | set(fresh)):
        a, b = committed.get(key), fresh.get(key)
        if a is None:
            out.append(f"{b.name} {b.version}: needed by the pinned set but not in it")
        elif b is None:
            out.append(f"{a.name} {a.version}: in the set but no longer resolved from its own pins")
        elif a.version != b.version:
            out.append(f"{a.name}: {a.version} committed, {b.version} resolved from the set's own pins")
        else:
            served = {x.sha256 for x in b.wheels} | ({b.sdist.sha256} if b.sdist else set())
            for f in list(a.wheels) + ([a.sdist] if a.sdist else []):
                if f.sha256 not in served:
                    out.append(f"{a.name} {a.version}: {f.filename} is not served with its committed sha256")
    return out


def verify_pinned(loaded: LoadedLock, path: Path | None = None) -> list[str]:
    """The promise of the committed set, which no later upload can change: resolved from its own
    pins (every package `name==version`, the lock's overrides, Python, platform, index and cut-off),
    it resolves to itself (nothing missing, no conflict) and the registry serves every committed
    file with its committed hash. Unlike `resolve_and_compare`, which asks what the lock's loose
    requirements resolve to today, the answer depends on no day's listing of newer releases."""
    res = check(loaded, path)
    if not res.packages:
        return res.problems
    pins = [f"{p.name}=={p.version}" + (f" ; {p.marker}" if p.marker else "") for p in res.packages.values()]
    fresh = pylock.parse(tomllib.loads(_uv_compile(loaded, pins)), f"pinned {loaded.name}")
    return res.problems + served_as_committed(res.packages, fresh)


def resolve_and_compare(loaded: LoadedLock) -> list[str]:
    """Resolve again against the registry and list every difference from the committed set."""
    fresh_text = resolve_text(loaded)
    fresh = pylock.parse(tomllib.loads(fresh_text), f"fresh {loaded.name}")
    res = check(loaded)
    if not res.packages:
        return res.problems
    return res.problems + differences(res.packages, fresh)


if __name__ == "__main__":  # pragma: no cover - a convenience for `python -m`
    sys.exit(pylock.main(sys.argv[1:]))
