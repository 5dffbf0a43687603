#!/usr/bin/env bash
# Build the muse-stack image of one lock. Every version comes from the lock through
# `muse-stack stack build-args`; this script only adds what is not a pin (revision, time, engine).
#   containers/build-image.sh TARGET_OR_LOCK
# Environment: ENGINE=docker|podman (docker: buildx), PY (python with muse_stack),
#   CA_BUNDLE=file (build secret `ca` for TLS-intercepting proxies), FIND_LINKS=dir (local wheels,
#   podman only), BASE_DIGEST=sha256:... (digest of a locally made base), ISOLATION (podman),
#   PUSH=1 (docker: push instead of load), MAX_JOBS (parallel compiles), EXTRA_BUILD_ARGS.
set -euo pipefail
lock="${1:?usage: build-image.sh TARGET_OR_LOCK}"
[[ -f "$lock" || ! -f "containers/locks/$lock.toml" ]] || lock="containers/locks/$lock.toml"
PY="${PY:-.venv/bin/python}"
ENGINE="${ENGINE:-docker}"

[[ -x "$PY" ]] || { echo "make image needs the project environment ($PY is missing): run make setup" >&2; exit 2; }
# one clear refusal before anything is pulled or installed: unresolved pins, a stale wheel set, a
# missing build tool, a builder that cannot produce the lock's platform
BASE_DIGEST="${BASE_DIGEST:-}" "$PY" -m muse_stack.cli stack preflight "$lock" --engine "$ENGINE" || exit 2

declare -A arg
while IFS='=' read -r k v; do arg[$k]="$v"; done < <("$PY" -m muse_stack.cli stack build-args "$lock")
tag=$("$PY" -m muse_stack.cli stack build-args --json "$lock" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tag"])')
[[ -n "${BASE_DIGEST:-}" ]] && arg[BASE_DIGEST]="$BASE_DIGEST"

build=()
for k in "${!arg[@]}"; do build+=(--build-arg "$k=${arg[$k]}"); done
build+=(--build-arg "SOURCE_REVISION=$(git rev-parse HEAD 2>/dev/null || true)")
build+=(--build-arg "SOURCE_URL=$(git remote get-url origin 2>/dev/null || true)")
build+=(--build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
build+=(--build-arg "BUILT_BY=$ENGINE")
[[ -n "${MAX_JOBS:-}" ]] && build+=(--build-arg "MAX_JOBS=$MAX_JOBS")
[[ -n "${CA_BUNDLE:-}" ]] && build+=(--secret "id=ca,src=$CA_BUNDLE")
# shellcheck disable=SC2206
[[ -n "${EXTRA_BUILD_ARGS:-}" ]] && build+=($EXTRA_BUILD_ARGS)
short="muse-stack:${arg[LOCK_NAME]}"

case "$ENGINE" in
  docker)
    out=(--load); [[ "${PUSH:-0}" = 1 ]] && out=(--push)
    docker buildx build --platform "${arg[PLATFORM]}" "${build[@]}" "${out[@]}" -t "$tag" -t "$short" -f Dockerfile . ;;
  podman)
    if [[ -n "${FIND_LINKS:-}" ]]; then
      build+=(-v "$FIND_LINKS:$FIND_LINKS:ro" --build-arg "PIP_FIND_LINKS=$FIND_LINKS")
    fi
    podman build ${ISOLATION:+--isolation="$ISOLATION"} --platform "${arg[PLATFORM]}" "${build[@]}" \
      -t "$tag" -t "$short" -f Dockerfile . ;;
  *) echo "ENGINE must be docker or podman, not $ENGINE" >&2; exit 2 ;;
esac
echo "$tag"
