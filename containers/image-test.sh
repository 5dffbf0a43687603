#!/usr/bin/env bash
# Image test (CI proof) for the cpu target, with no registry reachable:
#   1. make the Debian base with debootstrap + `podman import` (cached by the lock's base section),
#   2. build the image with `podman build --isolation=chroot` (podman's layer cache and the pip
#      cache mount make a second run fast),
#   3. run a step inside it (buildah from + buildah run --isolation chroot) with a host folder mounted
#      on /workspace/runs, as `docker run -v "$PWD/runs:/workspace/runs"` does, and check that the
#      run's files land in that host folder and that the entrypoint names it,
#   4. check that the image labels, /etc/muse-stack/image.json, the fingerprint written inside
#      the container and the lock file agree on the lock name and sha256.
# Exit 77 (the pytest wrapper skips on it) when the container tools cannot be installed or run.
#   containers/image-test.sh [TARGET]      (default cpu; only debootstrap-based locks)
set -euo pipefail
target="${1:-cpu}"
# a bare target name means this checkout's lock (not the one next to an installed muse_stack)
[[ -f "$target" || ! -f "containers/locks/$target.toml" ]] || target="containers/locks/$target.toml"
PY="${PY:-.venv/bin/python}"
export PY
SKIP=77
SECONDS=0
elapsed() { echo "$SECONDS"; }

# the step run inside the image: a run into the image's runs folder (a VOLUME), with a host folder
# mounted there; the run directory is found on the host afterwards
IN_IMAGE_STEP=(muse-stack run tiny-cpu --steps 3)

# --- tools ---------------------------------------------------------------------------------
need=(podman buildah debootstrap)
missing=(); for t in "${need[@]}"; do command -v "$t" >/dev/null || missing+=("$t"); done
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]}" >&2
    # MUSE_STACK_APT_LOCK: a lock file other installers take too (the test suite's workers), waited for
    ${MUSE_STACK_APT_LOCK:+flock "$MUSE_STACK_APT_LOCK"} bash -c \
      'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah debootstrap' >&2 \
      || { echo "SKIP: apt-get could not install podman buildah debootstrap" >&2; exit $SKIP; }
  else
    echo "SKIP: ${missing[*]} missing and cannot be installed (needs root and apt-get)" >&2; exit $SKIP
  fi
fi
[[ $(id -u) -eq 0 ]] || { echo "SKIP: debootstrap and chroot builds need root" >&2; exit $SKIP; }
podman info >/dev/null 2>&1 || { echo "SKIP: podman cannot run here: $(podman info 2>&1 | tail -1)" >&2; exit $SKIP; }

ca="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
links="${FIND_LINKS:-}"
[[ -z "$links" && -d /opt/wheels ]] && links=/opt/wheels

# --- 1. base ---------------------------------------------------------------------------------
base_digest=$(containers/make-base.sh "$target")
echo "[$(elapsed)s] base ready: $base_digest" >&2

# --- 2. build --------------------------------------------------------------------------------
tag=$("$PY" -m muse_stack.cli stack build-args --json "$target" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tag"])')
ENGINE=podman ISOLATION=chroot CA_BUNDLE="$ca" FIND_LINKS="$links" BASE_DIGEST="$base_digest" \
  containers/build-image.sh "$target" >/tmp/muse-stack-image-build.log 2>&1 \
  || { tail -40 /tmp/muse-stack-image-build.log >&2; echo "image build failed (log: /tmp/muse-stack-image-build.log)" >&2; exit 1; }
echo "[$(elapsed)s] built $tag" >&2

# --- 3. run inside ---------------------------------------------------------------------------
work=$(mktemp -d)
ctr=$(buildah from --pull-never "localhost/$tag")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
buildah run --isolation chroot "$ctr" -- /usr/local/bin/muse-stack-entrypoint --version
runs="$work/runs"
mkdir -p "$runs" && chmod 0777 "$runs"  # the image runs as its own user (uid 1000)
buildah run --isolation chroot -v "$runs:/workspace/runs" "$ctr" -- \
  /usr/local/bin/muse-stack-entrypoint "${IN_IMAGE_STEP[@]:1}" >"$work/run.err" 2>&1 \
  || { cat "$work/run.err" >&2; echo "the in-image run failed" >&2; exit 1; }
cat "$work/run.err" >&2
grep -q "mounted from" "$work/run.err" \
  || { echo "the entrypoint did not name the mounted runs folder" >&2; exit 1; }
mapfile -t made < <(find "$runs" -mindepth 1 -maxdepth 1 -type d -name 'tiny-cpu-*')
((${#made[@]} == 1)) || { echo "expected one run directory in the mounted folder $runs, found ${#made[@]}" >&2; exit 1; }
for f in recipe.yaml fingerprint.json metrics.jsonl results.json; do
  [[ -s "${made[0]}/$f" ]] || { echo "the run's $f is not in the mounted folder (${made[0]})" >&2; exit 1; }
done
cp "${made[0]}/fingerprint.json" "$work/fingerprint.json"
echo "[$(elapsed)s] the run's files are in the mounted host folder: ${made[0]}" >&2
# the image against its lock and wheel set, as the build's last step did: nothing outside the set
buildah run --isolation chroot "$ctr" -- /usr/local/bin/muse-stack-entrypoint stack selfcheck "$(basename "${target%.toml}")" --image >&2
buildah run --isolation chroot "$ctr" -- cat /etc/muse-stack/image.json >"$work/image.json"
podman image inspect "localhost/$tag" >"$work/inspect.json"
echo "[$(elapsed)s] ran: ${IN_IMAGE_STEP[*]}" >&2

# --- 4. identity checks ----------------------------------------------------------------------
"$PY" -m muse_stack.cli stack check "$target" --image-info "$work/image.json" --inspect "$work/inspect.json" >&2
"$PY" - "$target" "$work" <<'PY'
import json, sys
from pathlib import Path
from muse_stack.stack.lock import load
lk, work = load(sys.argv[1]), Path(sys.argv[2])
labels = json.loads((work / "inspect.json").read_text())[0]["Labels"]
info = json.loads((work / "image.json").read_text())
fp_path = work / "fingerprint.json"
fp = json.loads(fp_path.read_text()) if fp_path.exists() else None

def find(obj, key):
    """Every value of `key` anywhere in the fingerprint."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            yield from find(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from find(v, key)

want = {"lock_name": labels["dev.muse-stack.lock.name"], "lock_sha256": labels["dev.muse-stack.lock.sha256"]}
assert want == {"lock_name": lk.name, "lock_sha256": lk.sha256}, f"labels {want} != lock {lk.name} {lk.sha256}"
assert labels["org.opencontainers.image.base.digest"] == info["base_digest"], (labels, info)
assert labels["org.opencontainers.image.version"] == info["muse_stack_version"], (labels, info)
for key, val in want.items():
    assert info[key] == val, f"image.json {key}={info[key]!r}, label {val!r}"
    if fp is not None:
        found = set(map(str, find(fp, key)))
        assert found == {val}, f"fingerprint.json {key} = {sorted(found) or 'missing'}, image label {val!r}"
where = "labels, image.json and fingerprint.json" if fp is not None else "labels and image.json"
print(f"identity ok: lock {lk.name} sha256 {lk.sha256} in {where}")
PY
echo "image-test passed in $(elapsed)s" >&2
