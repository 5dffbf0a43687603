"""Pinned images: stack locks (containers/locks/*.toml), their validation and the build
arguments the Dockerfile and flake.nix consume."""

from muse_stack.stack.buildargs import KEYS, build_args, cuda_capabilities, image_tag
from muse_stack.stack.lock import Lock, LoadedLock, LockError, Null, load, locks_dir, unresolved

__all__ = [
    "KEYS",
    "Lock",
    "LoadedLock",
    "LockError",
    "Null",
    "build_args",
    "cuda_capabilities",
    "image_tag",
    "load",
    "locks_dir",
    "unresolved",
]
