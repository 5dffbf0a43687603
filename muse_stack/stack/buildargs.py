"""Build arguments, CUDA arch strings and image tags derived from a lock.

The Dockerfile consumes exactly these keys (tests/system/test_image_dockerfile.py checks it) and
containers/nix/lock.nix derives the same mapping in Nix (tests/system/test_stack_nix.py checks they
agree byte for byte). Every key is present for every lock; a component the lock leaves null
yields empty strings, so the key set is the same for all targets.
"""

from __future__ import annotations

from muse_stack.stack.lock import Lock, LoadedLock, Null, value

# the keys, in the order `muse-stack stack build-args` prints them
KEYS: tuple[str, ...] = (
    "LOCK_NAME",
    "LOCK_SHA256",
    "STACK_KIND",
    "PLATFORM",
    "BASE_IMAGE",
    "BASE_TAG",
    "BASE_DIGEST",
    "BASE_REF",
    "CUDA_VERSION",
    "PYTHON_VERSION",
    "APT_BASE_PACKAGES",
    "APT_BUILD_PACKAGES",
    "TORCH_PACKAGE",
    "TORCH_VERSION",
    "TORCH_INDEX_URL",
    "TE_VERSION",
    "TE_BUILD",
    "TE_CORE_PACKAGE",
    "TE_TORCH_PACKAGE",
    "TE_SOURCE_REPO",
    "TE_SOURCE_COMMIT",
    "NVTE_CUDA_ARCHS",
    "NVTE_WITH_NCCL_EP",
    "CUDNN_PACKAGE",
    "CUDNN_VERSION",
    "CUDNN_PURGE_APT",
    "NCCL_PACKAGE",
    "NCCL_VERSION",
    "FLASH_ATTN_PACKAGE",
    "FLASH_ATTN_VERSION",
    "FLASH_ATTN_CUDA_ARCHS",
    "DEEPEP_PACKAGE",
    "DEEPEP_VERSION",
    "DEEPEP_TORCH_CUDA_ARCH_LIST",
    "MEGATRON_CORE_PACKAGE",
    "MEGATRON_CORE_VERSION",
    "EFA_INSTALLER_VERSION",
    "EFA_INSTALLER_URL",
    "EFA_INSTALLER_SHA256",
    "EFA_INSTALL_FLAGS",
    "AWS_OFI_NCCL_VERSION",
    "LIBFABRIC_VERSION",
    "MUSE_STACK_VERSION",
)


def nvte_archs(caps: list[str]) -> str:
    """Transformer Engine's NVTE_CUDA_ARCHS (CMake style): ["9.0", "10.0"] -> "90;100"."""
    return ";".join(c.replace(".", "") for c in caps)


def flash_attn_archs(caps: list[str]) -> str:
    """flash-attn's FLASH_ATTN_CUDA_ARCHS: ["9.0", "10.0"] -> "90;100" (it ignores TORCH_CUDA_ARCH_LIST)."""
    return ";".join(c.replace(".", "") for c in caps)


def torch_arch_list(caps: list[str]) -> str:
    """PyTorch extensions' TORCH_CUDA_ARCH_LIST: ["9.0", "10.0"] -> "9.0;10.0"."""
    return ";".join(caps)


def cuda_capabilities(lock: Lock) -> list[str]:
    """Every capability the image compiles for (nixpkgs' cudaCapabilities): Transformer Engine's and
    flash-attn's, sorted numerically. DeepEP comes as its registry wheel; its archs are checked, not built."""
    caps: set[str] = set()
    for c in ("transformer_engine", "flash_attn"):
        comp = getattr(lock.components, c)
        if not isinstance(comp, Null):
            caps.update(comp.cuda_archs)
    return sorted(caps, key=lambda a: (int(a.split(".")[0]), a.split(".")[1]))


def _s(x: object) -> str:
    x = value(x)
    if x is None:
        return ""
    if isinstance(x, bool):
        return "1" if x else "0"
    return str(x)


def apt_pins(packages: dict[str, str]) -> str:
    """apt-get install's arguments for pinned packages, by name: {"git": "1:2.43.0"} -> "git=1:2.43.0"."""
    return " ".join(f"{name}={packages[name]}" for name in sorted(packages))


def build_args(loaded: LoadedLock) -> dict[str, str]:
    lock = loaded.lock
    c = lock.components
    te, cudnn, nccl, fa, dep, mc, efa = (
        c.transformer_engine,
        c.cudnn,
        c.nccl,
        c.flash_attn,
        c.deepep,
        c.megatron_core,
        c.efa,
    )

    def get(comp: object, attr: str) -> str:
        return "" if isinstance(comp, Null) else _s(getattr(comp, attr))

    def archs(comp: object, fmt) -> str:  # type: ignore[no-untyped-def]
        return "" if isinstance(comp, Null) else fmt(comp.cuda_archs)  # type: ignore[attr-defined]

    args = {
        "LOCK_NAME": lock.name,
        "LOCK_SHA256": loaded.sha256,
        "STACK_KIND": lock.kind,
        "PLATFORM": lock.platform,
        "BASE_IMAGE": lock.base.image,
        "BASE_TAG": lock.base.tag,
        "BASE_DIGEST": _s(lock.base.digest),
        "BASE_REF": lock.base.ref,
        "CUDA_VERSION": "" if isinstance(lock.cuda, Null) else lock.cuda.version,
        "PYTHON_VERSION": lock.python.version,
        "APT_BASE_PACKAGES": apt_pins(lock.apt.base),
        "APT_BUILD_PACKAGES": apt_pins(lock.apt.build),
        "TORCH_PACKAGE": c.torch.package,
        "TORCH_VERSION": c.torch.version,
        "TORCH_INDEX_URL": c.torch.index_url,
        "TE_VERSION": get(te, "version"),
        "TE_BUILD": get(te, "build"),
        "TE_CORE_PACKAGE": get(te, "core_package"),
        "TE_TORCH_PACKAGE": get(te, "torch_package"),
        "TE_SOURCE_REPO": get(te, "source_repo"),
        "TE_SOURCE_COMMIT": get(te, "source_commit"),
        "NVTE_CUDA_ARCHS": archs(te, nvte_archs),
        "NVTE_WITH_NCCL_EP": get(te, "with_nccl_ep"),
        "CUDNN_PACKAGE": get(cudnn, "package"),
        "CUDNN_VERSION": get(cudnn, "version"),
        "CUDNN_PURGE_APT": get(cudnn, "purge_apt_cudnn"),
        "NCCL_PACKAGE": get(nccl, "package"),
        "NCCL_VERSION": get(nccl, "version"),
        "FLASH_ATTN_PACKAGE": get(fa, "package"),
        "FLASH_ATTN_VERSION": get(fa, "version"),
        "FLASH_ATTN_CUDA_ARCHS": archs(fa, flash_attn_archs),
        "DEEPEP_PACKAGE": get(dep, "package"),
        "DEEPEP_VERSION": get(dep, "version"),
        "DEEPEP_TORCH_CUDA_ARCH_LIST": archs(dep, torch_arch_list),
        "MEGATRON_CORE_PACKAGE": get(mc, "package"),
        "MEGATRON_CORE_VERSION": get(mc, "version"),
        "EFA_INSTALLER_VERSION": get(efa, "installer_version"),
        "EFA_INSTALLER_URL": get(efa, "installer_url"),
        "EFA_INSTALLER_SHA256": get(efa, "installer_sha256"),
        "EFA_INSTALL_FLAGS": "" if isinstance(efa, Null) else " ".join(efa.install_flags),
        "AWS_OFI_NCCL_VERSION": get(efa, "aws_ofi_nccl"),
        "LIBFABRIC_VERSION": get(efa, "libfabric"),
        "MUSE_STACK_VERSION": c.muse_stack.version,
    }
    assert tuple(args) == KEYS, "build_args and KEYS disagree"
    return args


def image_tag(loaded: LoadedLock) -> str:
    """muse-stack:<target>-<muse-stack version>-<first 12 hex of the lock sha256>."""
    return f"muse-stack:{loaded.name}-{loaded.lock.components.muse_stack.version}-{loaded.sha256[:12]}"


def nix_system(platform: str) -> str:
    return {"linux/amd64": "x86_64-linux", "linux/arm64": "aarch64-linux"}[platform]


def summary(loaded: LoadedLock) -> dict[str, object]:
    """What `stack build-args --json` prints: the args plus the derived tag, system and capabilities."""
    return {
        "build_args": build_args(loaded),
        "tag": image_tag(loaded),
        "system": nix_system(loaded.lock.platform),
        "cuda_capabilities": cuda_capabilities(loaded.lock),
    }
