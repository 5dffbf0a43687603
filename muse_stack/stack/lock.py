"""Stack locks: one TOML file per target (containers/locks/<target>.toml) pinning every layer
of the training image. The lock is the only place a version lives; the Dockerfile, flake.nix
and the image test read it through :func:`muse_stack.stack.buildargs.build_args` or
containers/nix/lock.nix.

TOML has no null, so a value that is not known (a digest, a commit) or does not apply (TE on
the cpu target) is written as an explicit table with the reason: ``digest = { null = "why" }``.
Such a value loads as :class:`Null`, never as a guess.

The targets are the machine table's locks (``muse_stack/machine/machines.yaml``): a lock that builds
a machine's image is checked against the machine's platform and GPU arch when it loads.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from muse_stack.machine.table import Platform, table, table_path
from muse_stack.util.errors import MuseStackError

# the EFA installer's flags for a container build, as both sources of the pinned checksum run it
# (components.efa.installer_sha256_sources): --build-ngc, the installer's container mode, with the
# kernel module, limits, MPI and the self-test left out
EFA_CONTAINER_FLAGS = ("--build-ngc", "--skip-kmod", "--skip-limit-conf", "--skip-mpi", "--no-verify")

_ARCH = r"^\d{1,2}\.\d[af]?$"
_DIGEST = r"^sha256:[0-9a-f]{64}$"
_SHA256 = r"^[0-9a-f]{64}$"
_COMMIT = r"^[0-9a-f]{40}$"


class LockError(MuseStackError):
    """A stack lock is missing, malformed or breaks a rule."""


class Null(BaseModel):
    """An explicit null: the value is not known or does not apply, and ``reason`` says why."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    reason: str = Field(alias="null", min_length=8)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def value(x: Any) -> Any:
    """The pinned value, or None for an explicit :class:`Null`."""
    return None if isinstance(x, Null) else x


class Base(_Strict):
    source: Literal["registry", "debootstrap"]
    image: str = Field(pattern=r"^[a-z0-9][a-z0-9./_-]*$")
    tag: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
    # the tag's index (manifest list) digest, which FROM pulls for every platform of the lock
    digest: str | Null
    # where the pinned digest was read (public build logs and Dockerfiles, or the command that resolved it)
    digest_sources: list[str] = []
    suite: str | None = None
    mirror: str | None = None
    variant: str | None = None
    packages: list[str] = []

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str | Null) -> str | Null:
        if isinstance(v, str) and not re.match(_DIGEST, v):
            raise ValueError("must be sha256:<64 hex digits>")
        return v

    @model_validator(mode="after")
    def _debootstrap(self) -> Base:
        if self.source == "debootstrap" and not (self.suite and self.mirror and self.variant):
            raise ValueError("a debootstrap base needs suite, mirror and variant")
        if isinstance(self.digest, str) and not self.digest_sources:
            raise _Rule(
                "base.digest_sources",
                "a pinned digest names where it was read",
                "add `digest_sources = [\"...\"]` (the public sources, or `make pins gpu=TARGET` on a networked builder)",
            )
        return self

    @property
    def ref(self) -> str:
        """What FROM pulls: by digest when the digest is pinned, else by tag."""
        d = value(self.digest)
        return f"{self.image}@{d}" if d else f"{self.image}:{self.tag}"


class Reference(_Strict):
    recipe: str
    image: str
    digest: str | Null
    note: str = ""


class Cuda(_Strict):
    version: str = Field(pattern=r"^\d{2}\.\d$")

    @property
    def tuple(self) -> tuple[int, int]:
        major, minor = self.version.split(".")
        return int(major), int(minor)


class Python(_Strict):
    version: str = Field(pattern=r"^3\.\d{1,2}\.\d{1,2}$")
    source: Literal["distribution"]


class Torch(_Strict):
    package: str
    version: str = Field(pattern=r"^\d+\.\d+\.\d+(\+[a-z0-9]+)?$")
    index_url: str = Field(pattern=r"^https://")


class _Archs(_Strict):
    cuda_archs: list[str] = Field(min_length=1)

    @field_validator("cuda_archs")
    @classmethod
    def _archs(cls, v: list[str]) -> list[str]:
        for a in v:
            if not re.match(_ARCH, a):
                raise ValueError(f"{a!r} is not a CUDA capability like \"9.0\" or \"10.0\"")
        if len(set(v)) != len(v):
            raise ValueError("lists a capability twice")
        return v


class TransformerEngine(_Archs):
    version: str
    build: Literal["wheel", "source"]
    core_package: str
    torch_package: str
    # build = "wheel": the `transformer-engine` metapackage of the same version; TE's loader
    # refuses a PyPI-installed PyTorch extension unless metapackage, core and extension agree
    meta_package: str | None = None
    source_repo: str = Field(pattern=r"^https://")
    source_commit: str | Null
    # TE's optional NCCL EP extension (NVTE_WITH_NCCL_EP; a submodule built for sm90 and later): stated,
    # never left to TE's default
    with_nccl_ep: bool
    # build = "source": the runtime requirements of the source tree's setup.py, which the wheel
    # set must carry because the source build is installed without dependency resolution
    source_requires: list[str] = []

    @field_validator("source_commit")
    @classmethod
    def _commit(cls, v: str | Null) -> str | Null:
        if isinstance(v, str) and not re.match(_COMMIT, v):
            raise ValueError("must be a full git commit (40 hex digits)")
        return v


class Cudnn(_Strict):
    package: str
    version: str
    purge_apt_cudnn: bool

    @field_validator("purge_apt_cudnn")
    @classmethod
    def _purge(cls, v: bool) -> bool:
        if not v:
            raise ValueError(
                "must be true: the base image's apt cuDNN and the pinned pip cuDNN would be loaded together"
            )
        return v


class Nccl(_Strict):
    package: str
    version: str


class FlashAttn(_Archs):
    package: str
    version: str


class DeepEP(_Archs):
    package: str
    version: str


class MegatronCore(_Strict):
    package: str
    version: str


class Efa(_Strict):
    installer_version: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    installer_url: str = Field(pattern=r"^https://.*\.tar\.gz$")
    installer_sha256: str | Null
    # where the pinned checksum was read
    installer_sha256_sources: list[str] = []
    install_flags: list[str]
    aws_ofi_nccl: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    libfabric: str

    @field_validator("installer_sha256")
    @classmethod
    def _sha(cls, v: str | Null) -> str | Null:
        if isinstance(v, str) and not re.match(_SHA256, v):
            raise ValueError("must be 64 hex digits")
        return v

    @field_validator("install_flags")
    @classmethod
    def _flags(cls, v: list[str]) -> list[str]:
        missing = [f for f in EFA_CONTAINER_FLAGS if f not in v]
        if missing:
            raise ValueError(f"in a container the EFA installer needs {' '.join(missing)}")
        return v

    @model_validator(mode="after")
    def _url(self) -> Efa:
        if self.installer_version not in self.installer_url:
            raise ValueError("installer_url does not name installer_version")
        if isinstance(self.installer_sha256, str) and not self.installer_sha256_sources:
            raise _Rule(
                "components.efa.installer_sha256_sources",
                "a pinned checksum names where it was read",
                "add `installer_sha256_sources = [\"...\"]` (the public sources, or `make pins gpu=TARGET`)",
            )
        return self


class Resolution(_Strict):
    """How the lock's hash-pinned wheel set (containers/locks/pylock.<name>.toml) is resolved.

    ``exclude_newer`` fixes the registry's state: re-resolving later gives the same set unless
    a file was yanked or replaced, which the resolution test then reports.
    """

    index_url: str = Field(pattern=r"^https://")
    exclude_newer: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")
    manylinux: str = Field(pattern=r"^2_\d{2}$")
    find_links: list[str] = []
    note: str = ""


class Override(_Strict):
    """A pin that deliberately differs from what a dependency's metadata asks for."""

    package: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    version: str
    replaces: str = Field(min_length=8)
    note: str = Field(min_length=8)


class MuseStackPin(_Strict):
    version: str
    source: Literal["build-context"]


class Components(_Strict):
    torch: Torch
    transformer_engine: TransformerEngine | Null
    cudnn: Cudnn | Null
    nccl: Nccl | Null
    flash_attn: FlashAttn | Null
    deepep: DeepEP | Null
    megatron_core: MegatronCore | Null
    efa: Efa | Null
    muse_stack: MuseStackPin


CUDA_COMPONENTS = ("transformer_engine", "cudnn", "nccl", "flash_attn", "deepep")


class Deviation(_Strict):
    field: str
    recorded: str
    locked: str
    reason: str = Field(min_length=8)


_DEB_NAME = r"^[a-z0-9][a-z0-9.+-]+$"
_DEB_VERSION = r"^(\d+:)?[0-9][A-Za-z0-9.+~-]*$"


class Apt(_Strict):
    """The Debian packages the Dockerfile installs with apt, each at one version (``apt-get install
    NAME=VERSION``): ``base`` in every image's first stage, ``build`` in the GPU images' (the compilers and
    fetch tools of the sdist and EFA builds). ``sources`` says where the versions were read."""

    base: dict[str, str]
    build: dict[str, str] = {}
    sources: list[str] = Field(min_length=1)

    @field_validator("base", "build")
    @classmethod
    def _pins(cls, v: dict[str, str]) -> dict[str, str]:
        for name, version in v.items():
            if not re.match(_DEB_NAME, name):
                raise ValueError(f"{name!r} is not a Debian package name")
            if not re.match(_DEB_VERSION, version):
                raise ValueError(f"{name} = {version!r} is not a Debian version (write the exact version apt-cache policy shows)")
        return v


class Lock(_Strict):
    schema_version: Literal[1]
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    description: str
    platform: Platform
    base: Base
    reference: Reference | None = None
    cuda: Cuda | Null
    python: Python
    apt: Apt
    components: Components
    resolution: Resolution
    overrides: list[Override] = []
    deviations: list[Deviation] = []

    @property
    def kind(self) -> str:
        return "cpu" if isinstance(self.cuda, Null) else "gpu"

    @model_validator(mode="after")
    def _rules(self) -> Lock:
        comps = self.components
        python3 = self.apt.base.get("python3")
        if python3 is None or python3.split(":")[-1].split("-")[0] != self.python.version:
            raise _Rule(
                "apt.base.python3",
                f"the image's interpreter is the distribution's python3, which must be the lock's Python {self.python.version}",
                "pin `python3` in [apt.base] at the distribution version that carries it (apt-cache policy python3)",
                python3,
            )
        if isinstance(self.cuda, Null):
            present = [c for c in CUDA_COMPONENTS if not isinstance(getattr(comps, c), Null)]
            if present:
                raise _Rule(
                    f"components.{present[0]}",
                    "a lock without CUDA cannot pin CUDA components",
                    f"write `[components.{present[0]}]` as `null = \"why\"`, or pin [cuda] version",
                )
            return self
        if not self.apt.build:
            raise _Rule(
                "apt.build",
                "a CUDA lock's image compiles flash-attn and TE's extension and installs EFA: its build packages are pinned",
                "add `[apt.build]` (python3-dev, build-essential, git, curl at the versions apt-cache policy shows)",
            )
        missing = [c for c in CUDA_COMPONENTS if isinstance(getattr(comps, c), Null)]
        if missing:
            raise _Rule(
                f"components.{missing[0]}",
                "a CUDA lock pins every CUDA component",
                f"pin [components.{missing[0]}] (package, version, ...)",
            )
        cuda = self.cuda.tuple
        for c in ("transformer_engine", "flash_attn", "deepep"):
            for arch in getattr(comps, c).cuda_archs:
                if float(arch.rstrip("af")) >= 10.0 and cuda < (12, 8):
                    raise _Rule(
                        f"components.{c}.cuda_archs",
                        f"capability {arch} (sm100 and later) needs CUDA >= 12.8, the lock pins {self.cuda.version}",
                        "raise [cuda] version or drop the capability",
                        arch,
                    )
        return self


class _Rule(ValueError):
    """A cross-field rule broken; carries the field path and the fix for LockError."""

    def __init__(self, field: str, rule: str, fix: str, value: Any = None) -> None:
        super().__init__(rule)
        self.field, self.rule, self.fix, self.value = field, rule, fix, value


@dataclass(frozen=True)
class LoadedLock:
    lock: Lock
    path: Path
    sha256: str
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return self.lock.name


def locks_dir() -> Path:
    """containers/locks of this checkout, or $MUSE_STACK_LOCKS (the image sets it)."""
    env = os.environ.get("MUSE_STACK_LOCKS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "containers" / "locks"


def resolve(target_or_path: str | os.PathLike[str]) -> Path:
    s = str(target_or_path)
    p = Path(s)
    if s.endswith(".toml") or os.sep in s or p.exists():
        return p
    return locks_dir() / f"{s}.toml"


def _loc(loc: tuple[Any, ...]) -> str:
    # drop pydantic's union branch names ("Cudnn", "Null", "str") from the location
    def branch(x: Any) -> bool:
        return isinstance(x, str) and (x[:1].isupper() or "[" in x or x in ("str", "bool", "int"))

    parts = [str(x) for x in loc if not branch(x)]
    return ".".join(parts)


def _fix_for(err: dict[str, Any], field: str) -> str:
    t = err["type"]
    if t == "missing":
        return f"add `{field} = ...` to the lock, or `{field} = {{ null = \"why it is not known\" }}`"
    if t == "extra_forbidden":
        return f"remove `{field}` (not a lock field; check the spelling)"
    if t == "literal_error":
        return f"use one of {err.get('ctx', {}).get('expected', 'the allowed values')}"
    if t == "string_pattern_mismatch":
        return f"write `{field}` in the form {err.get('ctx', {}).get('pattern')}"
    return f"correct `{field}` (see containers/locks/b200.toml for a complete lock)"


def parse(data: dict[str, Any], *, where: str = "<lock>") -> Lock:
    try:
        return Lock.model_validate(data)
    except ValidationError as exc:
        errs = exc.errors()
        # prefer the error that is not merely "this is not a Null" from a union's other branch
        errs.sort(key=lambda e: (("null" in [str(x) for x in e["loc"]]) or "Null" in [str(x) for x in e["loc"]], 0))
        err = errs[0]
        ctx_err = err.get("ctx", {}).get("error")
        if isinstance(ctx_err, _Rule):
            raise LockError(
                f"{where}: {ctx_err.rule}", field=ctx_err.field, value=ctx_err.value, rule=ctx_err.rule, fix=ctx_err.fix
            ) from None
        field = _loc(err["loc"]) or "<top>"
        raise LockError(
            f"{where}: {err['msg']}",
            field=field,
            value=err.get("input") if not isinstance(err.get("input"), dict) else None,
            rule=err["msg"],
            fix=_fix_for(err, field),
        ) from None


def load(target_or_path: str | os.PathLike[str]) -> LoadedLock:
    """Read, hash (sha256 of the file bytes) and validate a lock; errors name the field and the fix."""
    path = resolve(target_or_path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        known = sorted(p.stem for p in locks_dir().glob("*.toml") if not p.stem.startswith("pylock."))
        raise LockError(
            f"no lock at {path}",
            field="target",
            value=str(target_or_path),
            fix=f"give a lock file path or one of the targets {', '.join(known) or ', '.join(table().locks())}",
            exit_code=3,
        ) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise LockError(
            f"{path}: not valid TOML: {exc}", field="file", value=str(path), fix="fix the TOML syntax", exit_code=3
        ) from None
    lock = parse(data, where=str(path))
    if lock.name != path.stem:
        raise LockError(
            f"{path}: the lock's name differs from its file name",
            field="name",
            value=lock.name,
            rule="a lock is named after its file (containers/locks/<name>.toml)",
            fix=f'set name = "{path.stem}" or rename the file to {lock.name}.toml',
        )
    _check_machine(lock, path)
    return LoadedLock(lock=lock, path=path, sha256=hashlib.sha256(raw).hexdigest(), data=data)


def _check_machine(lock: Lock, path: Path) -> None:
    """A lock that builds a machine's image (the machine table's ``lock``) is for that machine's
    platform and compiles its GPU's capability into every CUDA component."""
    machine_name = table().locks().get(lock.name)
    if machine_name is None:
        return
    m = table().machine(machine_name)
    where = f"machines.{machine_name} of {table_path()}"
    if lock.platform != m.platform:
        raise LockError(f"{path}: the {machine_name} machine is {m.platform}", field="platform", value=lock.platform,
                        rule=f"a lock builds for its machine's platform ({where})",
                        fix=f'set platform = "{m.platform}", or correct the machine\'s platform')
    if m.gpu is None:
        return
    if isinstance(lock.cuda, Null):
        raise LockError(f"{path}: the {machine_name} machine has GPUs and the lock pins no CUDA", field="cuda",
                        rule=f"a GPU machine's lock pins CUDA ({where})", fix="pin [cuda] version and its components")
    for c in ("transformer_engine", "flash_attn", "deepep"):
        archs = getattr(lock.components, c).cuda_archs
        if m.gpu.capability not in archs:
            raise LockError(f"{path}: {c} is not built for the {machine_name}'s {m.gpu.arch}",
                            field=f"components.{c}.cuda_archs", value=archs,
                            rule=f"a lock compiles its machine's capability {m.gpu.capability} ({where})",
                            fix=f'add "{m.gpu.capability}" to components.{c}.cuda_archs')


def pin_fix(name: str, fields: list[str]) -> str:
    """What a networked builder runs to resolve the named unresolved pins of lock NAME."""
    how = []
    if any(f in ("base.digest", "components.efa.installer_sha256") for f in fields):
        how.append(
            f"on a networked builder run `make pins gpu={name}` (muse-stack stack pins {name} --write): it reads "
            "the tag's index digest (`skopeo inspect --raw docker://IMAGE:TAG | sha256sum`, else `crane digest "
            "IMAGE:TAG`, else `docker buildx imagetools inspect IMAGE:TAG`) and hashes the EFA installer "
            "(`curl -fsSL URL | sha256sum`), then writes each value and its source into the lock"
        )
    if "components.transformer_engine.source_commit" in fields:
        how.append(
            "pin components.transformer_engine.source_commit to the full commit of the release tag "
            "(`git ls-remote SOURCE_REPO refs/tags/vX.Y^{}`)"
        )
    return "; ".join(how) or "pin the values named above"


def unresolved(lock: Lock) -> list[tuple[str, str]]:
    """Pins a release build should have but this lock leaves null: (field, reason)."""
    out: list[tuple[str, str]] = []
    if isinstance(lock.base.digest, Null) and lock.base.source == "registry":
        out.append(("base.digest", lock.base.digest.reason))
    c = lock.components
    if isinstance(c.efa, Efa) and isinstance(c.efa.installer_sha256, Null):
        out.append(("components.efa.installer_sha256", c.efa.installer_sha256.reason))
    te = c.transformer_engine
    if isinstance(te, TransformerEngine) and te.build == "source" and isinstance(te.source_commit, Null):
        out.append(("components.transformer_engine.source_commit", te.source_commit.reason))
    return out
