"""Container image references as the launchers write them.

One parser takes what ``--image`` may be:

- a Docker reference, ``[REGISTRY/]NAME[:TAG][@sha256:DIGEST]``: the first part is a registry when
  it holds a '.' or ':' or is ``localhost`` (Docker's own rule); otherwise the image is on Docker
  Hub, where a one-part name lives under ``library/``;
- an enroot URI, ``[docker://]REGISTRY#NAME[:TAG][@sha256:DIGEST]``;
- a squashfs file (``.sqsh``), imported once with ``enroot import`` (the way to pin a digest on
  any enroot: the file is the image, docs/launching.md).

Each is written in the form its consumer reads: pyxis's ``--container-image`` takes the enroot
form ``REGISTRY#NAME:TAG`` (Docker Hub images without a registry: enroot's default, with the
``library/`` namespace explicit; a digest as ``REGISTRY#NAME:sha256:DIGEST``), a Kubernetes container the Docker form with its registry
explicit (``docker.io/library/...``). A user name or password in the reference is refused: launch
files are shared, and enroot's credentials file or an image pull secret carries them instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from muse_stack.util.errors import UsageError

DOCKER_HUB = "docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
REGISTRY = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?")
SQUASHFS = re.compile(r"[A-Za-z0-9._/+=-]+\.(?:sqsh|squashfs)")

_FIX = ("give e.g. registry.example.com/muse-stack:gb200-0.1.0@sha256:<digest>, "
        "registry.example.com#muse-stack:gb200-0.1.0, or /shared/images/muse-stack-gb200.sqsh")


@dataclass(frozen=True)
class Image:
    registry: str | None  # None: Docker Hub
    repository: str | None  # e.g. library/ubuntu, team/muse-stack (None for a squashfs)
    tag: str | None = None
    digest: str | None = None
    squashfs: str | None = None  # an absolute .sqsh path

    @property
    def pinned(self) -> bool:
        """The reference names one image for good: a digest, or a squashfs file."""
        return self.digest is not None or self.squashfs is not None

    def enroot(self) -> str:
        """What pyxis's --container-image reads."""
        if self.squashfs:
            return self.squashfs
        ref = f"{self.registry}#{self.repository}" if self.registry else self.repository
        # a digest goes where enroot's URI grammar puts the tag ([[:alnum:]._:-]+): enroot fetches
        # /v2/NAME/manifests/sha256:..., the registry API's by-digest manifest, so the pull is
        # immutable on every enroot release (the tag, if any, is only a label then and is dropped)
        if self.digest:
            return f"{ref}:{self.digest}"
        return f"{ref}:{self.tag}"

    def oci(self) -> str:
        """A Kubernetes container's image: the Docker form, registry explicit."""
        if self.squashfs:
            raise UsageError("a squashfs file is an enroot image; Kubernetes pulls images from a registry",
                             field="--image", value=self.squashfs,
                             fix="give the registry reference the squashfs was imported from, e.g. "
                                 "registry.example.com/muse-stack:gb200-0.1.0@sha256:<digest>")
        ref = f"{self.registry or DOCKER_HUB}/{self.repository}"
        if self.tag:
            ref += f":{self.tag}"
        if self.digest:
            ref += f"@{self.digest}"
        return ref

    def record(self) -> str:
        """The reference as job files record it (MUSE_STACK_IMAGE; the fingerprint reads it)."""
        return self.squashfs or self.oci()


def _bad(why: str, value: str) -> UsageError:
    return UsageError(f"not an image reference: {why}", field="--image", value=value,
                      rule="[REGISTRY/]NAME[:TAG][@sha256:DIGEST], REGISTRY#NAME[:TAG][@sha256:DIGEST] or a .sqsh file",
                      fix=_FIX)


def parse(text: str) -> Image:
    """The image ``--image`` names; a UsageError naming --image otherwise."""
    if not isinstance(text, str) or not text or not all(c.isprintable() and not c.isspace() for c in text):
        raise _bad("it is empty or holds spaces or control characters", repr(text)[:80])
    ref = text
    for scheme in ("docker://", "dockerd://", "podman://"):
        if ref.startswith(scheme):
            if scheme != "docker://":
                raise _bad(f"{scheme} reads the submitting host's local images, which the cluster's nodes do not "
                           "have", text)
            ref = ref[len(scheme):]
            break
    if "://" in ref:
        scheme = ref.split("://", 1)[0]
        raise _bad(f"the scheme {scheme}:// is not an image registry's", "<redacted>" if "@" in ref else text)
    digest = None
    if "@" in ref:
        head, _, tail = ref.rpartition("@")
        if DIGEST.fullmatch(tail) and "@" not in head:
            ref, digest = head, tail
        else:
            # user:password@registry/..., user@registry#...: credentials never go in a launch file
            raise UsageError("the image reference holds a user name or password; launch files are shared and "
                             "record the image", field="--image", value="<redacted>",
                             fix="log in on the nodes instead (enroot's $ENROOT_CONFIG_PATH/.credentials for "
                                 "pyxis, `docker login`, an imagePullSecret on Kubernetes) and give the reference "
                                 "without user@")
    if ref.endswith((".sqsh", ".squashfs")) or ref.startswith(("/", "./", "../")):
        if digest is not None:
            raise _bad("a squashfs file is already one image; a digest cannot select from it", text)
        if not SQUASHFS.fullmatch(ref):
            raise _bad("a squashfs path is letters, digits and . _ / + = - ending in .sqsh", text)
        import os

        return Image(None, None, squashfs=os.path.abspath(ref))
    registry: str | None = None
    if "#" in ref:
        registry, _, ref = ref.partition("#")
        if not REGISTRY.fullmatch(registry):
            raise _bad(f"{registry!r} is not a registry host[:port]", text)
    else:
        first, sep, rest = ref.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            if not REGISTRY.fullmatch(first):
                raise _bad(f"{first!r} is not a registry host[:port]", text)
            registry, ref = first, rest
    tag = None
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        ref, _, tag = ref.rpartition(":")
        if not TAG.fullmatch(tag):
            raise _bad(f"the tag {tag!r} is not letters, digits, '_', '.' and '-' (at most 128)", text)
    if not REPOSITORY.fullmatch(ref):
        raise _bad(f"the name {ref!r} is not lower-case parts joined by '/'", text)
    if registry is not None and registry.lower() in _HUB_ALIASES:
        registry = None
    if registry is None and "/" not in ref:
        ref = f"library/{ref}"  # Docker Hub's official images, stated rather than implied
    if tag is None and digest is None:
        raise _bad("it names no tag or digest, and :latest moves", text)
    return Image(registry, ref, tag, digest)


#: the repository name of the images `make image` builds (tagged ``muse-stack:<lock>-<version>-<sha>``
#: and ``muse-stack:<lock>``); a squashfs imported from one is named ``muse-stack-<lock>...``
IMAGE_NAME = "muse-stack"


def lock_of(image: Image, locks: Iterable[str]) -> str | None:
    """The stack lock an image says it was built from, or None where its name does not say.

    Read from the tag of a ``.../muse-stack`` repository (``muse-stack:gb200-0.1.0``), from a
    repository named ``muse-stack-<lock>`` or from a squashfs file named ``muse-stack-<lock>...``
    (what ``enroot import`` of such an image is called): the part after the name is a lock, or
    starts with a lock and a '-'. The longest lock that fits wins. An image given by digest
    alone, or under another name, says nothing."""
    if image.squashfs is not None:
        stem = image.squashfs.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        rest = stem[len(IMAGE_NAME) + 1:] if stem.startswith(IMAGE_NAME + "-") else None
    else:
        name = (image.repository or "").rsplit("/", 1)[-1]
        if name == IMAGE_NAME:
            rest = image.tag
        elif name.startswith(IMAGE_NAME + "-"):
            rest = name[len(IMAGE_NAME) + 1:]
        else:
            rest = None
    if not rest:
        return None
    fits = [lock for lock in locks if rest == lock or rest.startswith(lock + "-")]
    return max(fits, key=len) if fits else None
