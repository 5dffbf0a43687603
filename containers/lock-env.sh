#!/bin/sh
# Build-time helper of the Dockerfile (installed as /usr/local/bin/lock-env); holds no versions.
# Trusts an extra CA bundle passed as build secret `ca` (TLS-intercepting proxies), then:
#   lock-env pip-install ARGS...                  pip install ARGS in the image's venv
#   lock-env pip-check VERSION DIST...            fail unless each DIST is installed at VERSION
#   lock-env fetch URL DEST SHA256                download, verify the checksum (required)
#   lock-env git-checkout REPO COMMIT DIR         clone and check out exactly COMMIT (and submodules)
#   lock-env set-pins NAME VERSION ...            fail unless the wheel set pins each NAME at VERSION
#   lock-env install-set [FIND_LINKS] [EXTRA_INDEX]  every wheel of the set, hashes required, no resolver
#   lock-env install-sdist NAME                   build and install NAME from the set's sdist (hash-checked)
#   lock-env fetch-sdist NAME DIR                 download NAME's sdist (hash-checked), unpack to DIR/src
#   lock-env link-libs DIR                        DIR/NAME -> the set's nvidia/NAME for every library folder of
#                                                 the set (cudnn, nccl, ...), DIR/cuda -> its nvidia/cuNN (NVRTC, cuRAND, ...)
#   lock-env lib-path ROOT                        the set's library path: ROOT/NAME/lib of every folder under ROOT
#                                                 that has one, by name (ROOT: the set's nvidia/ or link-libs' DIR);
#                                                 the one definition the image's and the replay's loader paths follow
#   lock-env lib-path-check ROOT PATH             fail unless the loader path PATH starts with lib-path ROOT
#   lock-env efa-links ROOT DIR                   DIR/ofi-nccl-lib (holding libnccl-net-ofi.so only),
#                                                 DIR/libfabric-lib -> the folders the EFA installer used
#                                                 under ROOT (lib, lib64 or lib/<triplet>)
set -eu
SET=${MUSE_STACK_WHEELSET:-/usr/local/lib/muse-stack/wheelset.toml}
PYLOCK=${MUSE_STACK_PYLOCK:-/usr/local/lib/muse-stack/pylock.py}
if [ -s /run/secrets/ca ]; then
  export PIP_CERT=/run/secrets/ca CURL_CA_BUNDLE=/run/secrets/ca GIT_SSL_CAINFO=/run/secrets/ca
  export SSL_CERT_FILE=/run/secrets/ca REQUESTS_CA_BUNDLE=/run/secrets/ca
fi
cmd="$1"; shift
case "$cmd" in
  pip-install)
    exec python -m pip install --progress-bar off "$@" ;;
  pip-check)
    want="$1"; shift
    exec python - "$want" "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
want, dists = sys.argv[1], sys.argv[2:]
for d in dists:
    try:
        got = version(d)
    except PackageNotFoundError:
        sys.exit(f"{d} is not installed; the lock pins {want}")
    if got != want and not got.startswith(want + "+"):
        sys.exit(f"{d} {got} is installed; the lock pins {want}")
    print(f"{d} {got} (lock {want})")
PY
    ;;
  set-pins)
    exec python3 "$PYLOCK" pins "$SET" "$@" ;;
  install-set)
    links="${1:-}"; extra="${2:-}"
    python3 "$PYLOCK" requirements "$SET" --no-sdists > /tmp/wheelset-requirements.txt
    set -- --require-hashes --no-deps --only-binary :all: -r /tmp/wheelset-requirements.txt
    # a local wheel directory stands in for the extra index (torch's +cpu wheels), not beside it
    if [ -n "$links" ]; then set -- "$@" --find-links "$links"
    elif [ -n "$extra" ]; then set -- "$@" --extra-index-url "$extra"; fi
    python -m pip install --progress-bar off "$@"
    rm -f /tmp/wheelset-requirements.txt ;;
  install-sdist)
    name="$1"
    python3 "$PYLOCK" requirements "$SET" --only "$name" --sdist "$name" > /tmp/sdist-requirements.txt
    python -m pip install --progress-bar off --require-hashes --no-deps --no-build-isolation \
      --no-binary "$name" -r /tmp/sdist-requirements.txt
    rm -f /tmp/sdist-requirements.txt ;;
  fetch-sdist)
    name="$1"; dir="$2"
    set -- $(python3 "$PYLOCK" sdist "$SET" "$name")
    mkdir -p "$dir/src"
    "$0" fetch "$1" "$dir/sdist.tar.gz" "$2"
    tar -xzf "$dir/sdist.tar.gz" -C "$dir/src" --strip-components=1 ;;
  link-libs)
    dir="$1"
    site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$dir"
    # every library folder of the set, under its own name (the CUDA major's nvidia/cuNN as `cuda`)
    for folder in "$site"/nvidia/*/lib; do
      [ -d "$folder" ] || continue
      name=$(basename "$(dirname "$folder")")
      case "$name" in cu[0-9]*) link=cuda ;; *) link=$name ;; esac
      ln -sfn "$(dirname "$folder")" "$dir/$link"
    done
    for lib in cudnn nccl; do
      ls "$dir/$lib"/lib/lib"$lib".so.* >/dev/null || { echo "the set's $lib wheel has no lib$lib.so under $site/nvidia/$lib" >&2; exit 1; }
    done
    # TE's loader reads NVRTC_HOME / CURAND_HOME before CUDA_HOME (the base's toolkit): point them at the
    # set's CUDA libraries, the one nvidia/cuNN folder of the set's CUDA major
    set -- "$site"/nvidia/cu[0-9]*
    [ $# -eq 1 ] && [ -d "$1" ] || { echo "the set has not exactly one nvidia/cuNN folder under $site: $*" >&2; exit 1; }
    ln -sfn "$1" "$dir/cuda"
    for lib in nvrtc curand; do
      ls "$dir/cuda"/lib/lib"$lib".so.* >/dev/null || { echo "the set has no lib$lib.so under $1/lib" >&2; exit 1; }
    done ;;
  lib-path)
    out=""
    for folder in $(LC_ALL=C ls -d "$1"/*/lib 2>/dev/null); do
      [ -d "$folder" ] && out="${out:+$out:}$folder"
    done
    [ -n "$out" ] || { echo "no library folder (NAME/lib) under $1" >&2; exit 1; }
    echo "$out" ;;
  lib-path-check)
    want=$(sh "$0" lib-path "$1") || exit 1
    case "$2:" in
      "$want":*) ;;
      *) echo "the loader path does not start with the set's library folders ($0 lib-path $1):" >&2
         echo "  want $want" >&2; echo "  have $2" >&2; exit 1 ;;
    esac ;;
  fetch)
    url="$1"; dest="$2"; sum="${3:-}"
    # nothing is downloaded without the checksum it must have
    [ -n "$sum" ] || { echo "lock-env fetch: no sha256 for $url; the lock must pin it (make pins gpu=TARGET)" >&2; exit 1; }
    curl -fsSL --retry 3 -o "$dest" "$url"
    echo "$sum  $dest" | sha256sum -c - ;;
  efa-links)
    root="$1"; dir="$2"
    mkdir -p "$dir"
    # first folder (flat lib, lib64, then the multiarch lib/<triplet>) holding the file
    find_dir() {
      for d in "$1/lib" "$1/lib64" "$1"/lib/*-linux-gnu; do
        if [ -e "$d/$2" ]; then echo "$d"; return 0; fi
      done
      return 1
    }
    plugin=$(find_dir "$root/ofi-nccl" libnccl-net-ofi.so) \
      || { echo "no libnccl-net-ofi.so under $root/ofi-nccl/lib, lib64 or lib/<triplet>" >&2; exit 1; }
    fabric=$(find_dir "$root/efa" libfabric.so.1) \
      || { echo "no libfabric.so.1 under $root/efa/lib, lib64 or lib/<triplet>" >&2; exit 1; }
    # the plugin under its own name only: NCCL loads libnccl-net.so (which the installer also puts
    # there) whenever it finds one, and the plugin is opt-in (NCCL_NET_PLUGIN=ofi, set for EFA jobs)
    rm -rf "$dir/ofi-nccl-lib"; mkdir -p "$dir/ofi-nccl-lib"
    ln -sfn "$plugin/libnccl-net-ofi.so" "$dir/ofi-nccl-lib/libnccl-net-ofi.so"
    ln -sfn "$fabric" "$dir/libfabric-lib"
    echo "aws-ofi-nccl: $plugin; libfabric: $fabric" ;;
  git-checkout)
    repo="$1"; commit="$2"; dir="$3"
    git init -q "$dir"
    git -C "$dir" fetch -q --depth 1 "$repo" "$commit"
    git -C "$dir" checkout -q FETCH_HEAD
    test "$(git -C "$dir" rev-parse HEAD)" = "$(git -C "$dir" rev-parse "$commit^{commit}")"
    git -C "$dir" submodule update -q --init --recursive --depth 1 ;;
  image-json)
    # image-json PATH lock_name lock_sha256 base_image base_digest source_revision muse_stack_version platform built_by
    out="$1"; shift
    mkdir -p "$(dirname "$out")"
    exec python - "$out" "$@" <<'PY'
import json, sys
keys = ["lock_name", "lock_sha256", "base_image", "base_digest", "source_revision",
        "muse_stack_version", "platform", "built_by"]
out, vals = sys.argv[1], sys.argv[2:]
if len(vals) != len(keys):
    sys.exit(f"image-json needs {len(keys)} values, got {len(vals)}")
info = dict(zip(keys, vals))
for k in ("base_digest", "source_revision"):
    info[k] = info[k] or None
with open(out, "w") as fh:
    json.dump(info, fh, indent=2)
    fh.write("\n")
PY
    ;;
  *)
    echo "lock-env: unknown command $cmd" >&2; exit 2 ;;
esac
