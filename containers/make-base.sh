#!/usr/bin/env bash
# Make the base image of a debootstrap lock (the cpu target) without any registry:
# debootstrap the lock's suite/variant/packages, tar it, `$ENGINE import` it (podman|docker) as the lock's
# base image. The tarball is cached under $MUSE_STACK_CACHE/base/<key>.tar, where <key> is the
# sha256 of the lock's [base] section and platform (editing other pins keeps the cache).
# Prints the digest of the imported base image.
#   containers/make-base.sh TARGET_OR_LOCK
set -euo pipefail
lock="${1:?usage: make-base.sh TARGET_OR_LOCK}"
[[ -f "$lock" || ! -f "containers/locks/$lock.toml" ]] || lock="containers/locks/$lock.toml"
PY="${PY:-.venv/bin/python}"
ENGINE="${ENGINE:-podman}"
cache="${MUSE_STACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/muse-stack}/base"

# shellcheck disable=SC2046
eval "$("$PY" - "$lock" <<'PY'
import hashlib, json, shlex, sys
from muse_stack.stack.lock import load
lk = load(sys.argv[1])
base = lk.data["base"]
if base.get("source") != "debootstrap":
    sys.exit(f"{lk.path}: base.source is {base.get('source')!r}; only debootstrap bases are made locally")
key = hashlib.sha256(json.dumps({"base": base, "platform": lk.lock.platform}, sort_keys=True).encode()).hexdigest()
arch = {"linux/amd64": "amd64", "linux/arm64": "arm64"}[lk.lock.platform]
for k, v in {"KEY": key, "ARCH": arch, "SUITE": base["suite"], "MIRROR": base["mirror"], "VARIANT": base["variant"],
             "PACKAGES": ",".join(base.get("packages", [])), "REF": f"{base['image']}:{base['tag']}"}.items():
    print(f"{k}={shlex.quote(v)}")
PY
)"

tarball="$cache/$KEY.tar"
if [[ ! -s "$tarball" ]]; then
  mkdir -p "$cache"
  work=$(mktemp -d "$cache/.debootstrap.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  echo "debootstrap $SUITE ($VARIANT, $ARCH) from $MIRROR" >&2
  debootstrap --arch="$ARCH" --variant="$VARIANT" ${PACKAGES:+--include="$PACKAGES"} \
    "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/var/log/*.log
  tar --numeric-owner --sort=name -C "$work/rootfs" -cf "$work/base.tar" .
  mv "$work/base.tar" "$tarball"
fi

have=$("$ENGINE" image inspect "$REF" --format '{{index .Labels "dev.muse-stack.base.key"}}' 2>/dev/null || true)
if [[ "$have" != "$KEY" ]]; then
  echo "$ENGINE import $tarball -> $REF" >&2
  "$ENGINE" import --change "LABEL dev.muse-stack.base.key=$KEY" "$tarball" "$REF" >/dev/null
fi
# podman: the manifest digest of the imported image; docker (no manifest for local images): its id
if [[ "$ENGINE" = podman ]]; then podman image inspect "$REF" --format '{{.Digest}}'
else "$ENGINE" image inspect "$REF" --format '{{.Id}}'; fi
