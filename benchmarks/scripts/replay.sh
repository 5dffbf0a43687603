#!/usr/bin/env bash
# Replay a lock's hash-pinned wheel set on a GPU machine that reaches no registry, in an interpreter
# that sees nothing but the set, then run the recorded stack: self-check, isolation proof,
# fingerprint, slice-1gpu, parity, audit, diff and compare. One lock at a time.
#
#   here:   bash benchmarks/scripts/replay.sh files LOCK     # every file of the set prepare fetches
#           bash benchmarks/scripts/replay.sh prepare LOCK   # fetch them all, hash-checked, into .whl/replay-LOCK-src
#           CHUNK=54m bash benchmarks/scripts/stage-gpu.sh pack .whl/replay-LOCK-src .whl/replay-LOCK-stage
#   device: bash benchmarks/scripts/stage-gpu.sh receive K .whl/replay-LOCK-stage   # one call per chunk
#           bash benchmarks/scripts/replay.sh install LOCK   # unpack; venv; every wheel, --require-hashes
#           bash benchmarks/scripts/replay.sh fa-start LOCK  # flash-attn from the set's sdist for the lock's archs, in the background
#           bash benchmarks/scripts/replay.sh te LOCK        # TE's PyTorch extension from the set's sdist
#           bash benchmarks/scripts/replay.sh check LOCK     # stack selfcheck --image, then `isolation`
#           bash benchmarks/scripts/replay.sh run LOCK       # slice-1gpu, parity, audit, diff, compare
#           bash benchmarks/scripts/replay.sh fa-status LOCK # poll; once built: fa-check, selfcheck and audit again
#           bash benchmarks/scripts/replay.sh fa-check LOCK  # flash-attn's archs, one forward and backward against
#                                                            # torch's SDPA (benchmarks/scripts/flash_attn_check.py)
#   here:   bash benchmarks/scripts/replay.sh fa-fetch LOCK  # the set's flash-attn sdist alone (6 MB, hash-checked)
#                                                            # into .whl/replay-LOCK-fa, where the set is installed already
#   any:    bash benchmarks/scripts/replay.sh isolation LOCK # the proof alone (also run by check and run)
#
# Isolation: the set goes into a virtual environment made with the machine's python3 and
# `--without-pip` (no system site-packages, so the image's torch 2.11 and its ~120 other packages
# are not on sys.path), installed by the machine's pip with `--python VENV/bin/python --no-index
# --require-hashes`: all of the set's wheels, the CUDA libraries the image also has among them.
# Every python of the replay runs as VENV/bin/python -E -s (PYTHONPATH and the user site ignored),
# with the set's CUDA library folders (VENV/.../nvidia/*/lib) first on LD_LIBRARY_PATH and TE's
# library homes (CUDNN_HOME, NVRTC_HOME, CURAND_HOME) in the venv. `isolation` fails unless those
# hold, every imported module's file lies in the venv, the base python's standard library or this checkout's muse_stack; the machine's torch cannot be found once
# the venv is left out; exactly the set is installed; and every CUDA library mapped in the process
# (and in the run's fingerprint) comes from the venv, each from one file.
#
# Each device step writes under /tmp/replay-LOCK/out and ships it whole as $OUT/replay-LOCK.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
usage="usage: replay.sh files|prepare|install|te|fa-fetch|fa-start|fa-status|fa-check|check|isolation|run LOCK"
cmd=${1:?$usage}
lock=${2:?LOCK (b200, h200, gb200)}
case "$lock" in *[!a-z0-9_-]*) echo "LOCK must be a lock name such as b200, not '$lock'" >&2; exit 2 ;; esac
PYLOCK=${PYLOCK:-containers/locks/pylock.$lock.toml}
LOCKFILE=${LOCKFILE:-containers/locks/$lock.toml}
# the machine's interpreter, by its full path (the venv's bin/ goes first on PATH later): it makes
# the venv and runs pip, nothing else
PY=$(command -v "${PY:-python3}") || { echo "no python3 on PATH (or set PY)" >&2; exit 2; }
# pip reads nothing but its command line: no configuration file, no PIP_* variable (a machine's
# find-links, index or constraints file stay out of the replay)
for v in $(compgen -e | grep '^PIP_'); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${VENV:-/tmp/replayenv-$lock}        # the isolated interpreter (device)
WORK=${WORK:-/tmp/replay-$lock}           # device: the unpacked set, builds, logs
SRC=${SRC:-$WORK/src}                     # device: the staged files, unpacked
STAGE=${STAGE:-.whl/replay-$lock-stage}   # the chunks carried to the device (git-ignored)
RES=${RES:-$WORK/out}                     # device: results, shipped after every step
OUT=${OUT:-replay-out}
RECORD=${RECORD:-attune-b200}             # the catalogue recipe whose recorded stack the audit checks
AGAINST=${AGAINST:-benchmarks/results/replay-h200}  # the run that diff and compare are made against
[ -f "$PYLOCK" ] || { echo "no wheel set $PYLOCK: LOCK names containers/locks/pylock.LOCK.toml" >&2; exit 2; }

set_files() { # one line per file prepare fetches: package, file name, sha256, url (every package of the set)
  "$PY" - "$PYLOCK" <<'PY'
import sys
sys.path.insert(0, "muse_stack/stack")
import pylock
doc, pkgs = pylock.load(sys.argv[1])
sdists = {pylock.canonical(n) for n in doc.get("tool", {}).get("muse-stack", {}).get("sdists", [])}
for key in sorted(pkgs):
    p = pkgs[key]
    # the packages the image compiles come as their sdist; every other one as all of its wheels
    files = [p.sdist] if key in sdists or not p.wheels else list(p.wheels)
    if None in files:
        sys.exit(f"{p.name} {p.version}: the set names it among its sdists but pins no sdist of it")
    for a in files:
        print(key, a.filename, a.sha256, a.url)
PY
}

sdist_names() { # the packages of the set built here from their sdists (tool.muse-stack.sdists)
  "$PY" -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb")).get("tool", {}).get("muse-stack", {}).get("sdists", [])))' "$PYLOCK"
}

lock_value() { # lock_value SECTION KEY: a value of the lock's [components.SECTION] (lists joined by ;)
  "$PY" - "$LOCKFILE" "$1" "$2" <<'PY'
import sys, tomllib
v = tomllib.load(open(sys.argv[1], "rb"))["components"][sys.argv[2]].get(sys.argv[3], "")
print(";".join(str(a).replace(".", "") for a in v) if isinstance(v, list) else str(v).lower())
PY
}

enter_env() { # the environment every replay python runs in: the venv alone, the set's CUDA libraries first
  [ -x "$VENV/bin/python" ] || { echo "no venv at $VENV: run \`replay.sh install $lock\` first" >&2; exit 1; }
  SP=$("$VENV/bin/python" -E -s -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 1
  unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PYTHONUSERBASE PYTHONSAFEPATH
  export PYTHONNOUSERSITE=1 VIRTUAL_ENV=$VENV PATH=$VENV/bin:$PATH
  # the set's library path as the image's: containers/lock-env.sh lib-path, of the set's nvidia/ here
  # and of the links to it there (the one definition of both)
  local libs; libs=$(sh containers/lock-env.sh lib-path "$SP/nvidia" 2>/dev/null)
  [ -n "$libs" ] || { echo "no nvidia/*/lib folders in $SP: the set's CUDA wheels are not installed" >&2; exit 1; }
  # the set's folders before anything the machine had there (its driver's folder stays, after them)
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # TE 2.17's loader opens cuDNN, NVRTC and cuRAND from <LIB>_HOME, <LIB>_PATH, CUDA_HOME, CUDA_PATH,
  # /usr/local/cuda, in that order, before the wheels: the machine's toolkit would be a second NVRTC
  # beside the one torch maps from the set. Each is pointed at the set's folder. CUDA_HOME stays the
  # machine's toolkit: nvcc for the builds, and the headers TE's NVRTC kernels include.
  export CUDNN_HOME=$SP/nvidia/cudnn CUDNN_PATH=$SP/nvidia/cudnn NCCL_HOME=$SP/nvidia/nccl
  export NVRTC_HOME=$SP/nvidia/cu13 CURAND_HOME=$SP/nvidia/cu13
  VPY=("$VENV/bin/python" -E -s -u)
}

ship() { # everything this lock's steps wrote so far, as one file back from the device
  [ -d "$RES" ] || return 0
  mkdir -p "$OUT" && tar -C "$(dirname "$RES")" -czf "$OUT/replay-$lock.tgz" "$(basename "$RES")"
}

isolation() { # isolation [FINGERPRINT]: the proof (see the header); exit 1 with each finding on a failure
  local machine_torch=${MACHINE_TORCH-}
  if [ -z "${MACHINE_TORCH+set}" ]; then # where the machine's own python finds torch (not imported)
    machine_torch=$("$PY" -c 'import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.dirname(s.origin) if s and s.origin else "")' 2>/dev/null)
  fi
  mkdir -p "$RES"
  "${VPY[@]}" - "$VENV" "$PYLOCK" "$machine_torch" "${IMPORTS-}" "${CHECK_GPU:-1}" "${1:-}" \
    "$RES/isolation${1:+-fingerprint}.json" "$(sdist_names)" <<'PY'
import importlib, importlib.metadata as md, importlib.util, json, os, re, sys, sysconfig, tomllib
venv, pylock_path, machine_torch, imports, gpu, fingerprint, report_path, sdists = sys.argv[1:9]
real = os.path.realpath
VENV = real(venv)
REPO = real(os.getcwd())
problems, notes = [], []

def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")

stdlib = {real(sysconfig.get_paths(vars={"installed_base": sys.base_prefix, "base": sys.base_prefix,
                                        "platbase": sys.base_prefix, "installed_platbase": sys.base_prefix})[k])
          for k in ("stdlib", "platstdlib")}

def allowed(path):
    p, a = real(path), os.path.abspath(path)
    if under(p, VENV) or under(p, os.path.join(REPO, "muse_stack")):
        return True
    # the base interpreter's own library, never a site-packages or dist-packages beside it (by the
    # path it was imported from: Debian's sitecustomize.py there is a link into /etc/python3.X)
    return (any(under(p, s) or under(a, s) for s in stdlib)
            and not any(re.search(r"/(site|dist)-packages(/|$)", x) for x in (p, a)))

# 0. the loader's path starts with the venv's CUDA library folders, and TE's <LIB>_HOME are the venv's
import glob
site = sysconfig.get_paths()["purelib"]
venv_libs = sorted(real(d) for d in glob.glob(os.path.join(site, "nvidia", "*", "lib")))
ld_path = [e for e in os.environ.get("LD_LIBRARY_PATH", "").split(":") if e]
if not venv_libs:
    problems.append(f"no nvidia/*/lib folder in {site}: the set's CUDA wheels are not installed")
elif sorted(real(e) for e in ld_path[:len(venv_libs)]) != venv_libs:
    problems.append("LD_LIBRARY_PATH does not start with the venv's CUDA library folders: " + ":".join(ld_path))
homes = {v: os.environ.get(v) for v in ("CUDNN_HOME", "CUDNN_PATH", "NVRTC_HOME", "CURAND_HOME")}
for var, value in homes.items():
    if not value or not under(real(value), VENV):
        problems.append(f"{var} is {value!r}, not a folder of the venv: TE would load that library from elsewhere")

# 1. this is the venv, and nothing but it, the standard library and the checkout is on sys.path
if real(sys.prefix) != VENV or sys.prefix == sys.base_prefix:
    problems.append(f"not running in the venv {VENV}: sys.prefix {sys.prefix}, base {sys.base_prefix}")
for entry in sys.path:
    p = real(entry or os.getcwd())
    stdlib_zip = entry.endswith(".zip") and any(real(os.path.dirname(entry)) == os.path.dirname(s) for s in stdlib)
    if not (allowed(p) or p == REPO or stdlib_zip):
        problems.append(f"sys.path holds {entry!r}, outside the venv and the standard library")

# 2. import the stack, and exercise the GPU libraries so that the lazily loaded ones are mapped
wanted = [m for m in imports.split(",") if m] if imports else [
    "torch", "triton", "transformer_engine", "transformer_engine.pytorch", "megatron.core", "deep_ep",
    "flash_attn", "numpy", "pydantic", "typer", "rich", "datasets", "tensorboard", "wandb", "muse_stack.cli",
    "muse_stack.engines.megatron"]
for name in wanted:
    try:
        importlib.import_module(name)
    except Exception as exc:  # a module that does not import is a finding, not a leak
        (notes if name == "flash_attn" else problems).append(f"import {name} failed: {type(exc).__name__}: {exc}")
if gpu == "1":
    try:
        import torch
        a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        (a @ a).sum().backward()
        import transformer_engine.pytorch as te
        lin = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
        lin(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)).sum().backward()
        attn = te.DotProductAttention(4, 64, attn_mask_type="causal").cuda()
        q, k, v = (torch.randn(128, 2, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        attn(q, k, v).float().sum().backward()
        torch.cuda.synchronize()
        notes.append("exercised: bf16 matmul, TE Linear and DotProductAttention forward and backward")
    except Exception as exc:
        problems.append(f"GPU exercise failed: {type(exc).__name__}: {exc}")

# 3. every imported module's file
outside = {}
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if not isinstance(f, str) or not (os.path.isabs(f) or os.path.exists(f)):
        continue  # this check itself (<stdin>), and names that are no file (torch.classes: "_classes.py")
    if not allowed(f):
        outside[name] = f
for name, f in sorted(outside.items()):
    problems.append(f"module {name} imported from {f}, outside the venv")

# 4. the machine's torch: not on any path, and not found once the venv's site-packages is left out
spec = importlib.util.find_spec("torch")
if spec is not None and spec.origin and not under(real(spec.origin), VENV):
    problems.append(f"torch resolves to {spec.origin}, outside the venv")
if machine_torch:
    mt = real(machine_torch)
    for entry in sys.path:
        if entry and under(mt, real(entry)):
            problems.append(f"the machine's torch {mt} lies under sys.path entry {entry}")
saved = list(sys.path)
sys.path[:] = [e for e in sys.path if not under(real(e or os.getcwd()), VENV)]
importlib.invalidate_caches()
other = importlib.machinery.PathFinder.find_spec("torch", sys.path)
sys.path[:] = saved
if other is not None:
    problems.append(f"without the venv, torch is still found: {other.origin}")

# 5. exactly the set is installed, each distribution in the venv
doc = tomllib.load(open(pylock_path, "rb"))
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
want = {canon(p["name"]): str(p["version"]) for p in doc.get("packages", [])}
built_here = {canon(n) for n in sdists.split()}
have = {}
for d in md.distributions():
    name = d.metadata.get("Name")
    if not name:
        continue
    loc = real(str(d.locate_file("")))
    # a copy that a package of the set carries inside its own folder (setuptools puts its _vendor
    # folder on sys.path when imported, so its vendored dist-infos are found): part of that package
    info = real(str(getattr(d, "_path", "")))
    inner = os.path.relpath(info, real(site)).split(os.sep) if under(info, real(site)) else []
    if len(inner) >= 3 and inner[1] == "_vendor" and os.path.isdir(os.path.join(site, inner[0])):
        notes.append(f"{name} {d.version} is vendored inside the set's {inner[0]}")
        continue
    if not under(loc, VENV) and not (canon(name) == "muse-stack" and loc == REPO):  # the checkout under test
        problems.append(f"distribution {name} {d.version} is installed at {loc}, outside the venv")
    have.setdefault(canon(name), d.version)
for key, v in sorted(want.items()):
    got = have.get(key)
    if got is None:
        (notes if key in built_here else problems).append(f"{key} {v} of the set is not installed")
    elif got != v and got.split("+")[0] != v:
        problems.append(f"{key} is {got}, the set pins {v}")
if have.pop("muse-stack", None):
    notes.append("muse-stack is this checkout's (its egg-info), not a distribution of the set")
extra = sorted(set(have) - set(want))
if extra:
    problems.append("installed outside the set: " + ", ".join(f"{k} {have[k]}" for k in extra))

# 6. the CUDA libraries mapped in this process: from the venv only, each from one file
CUDA = re.compile(r"^lib(cudart|nvrtc|nvrtc-builtins|cublas|cublasLt|cudnn(_[a-z_]+)?|nccl|nvJitLink|nvshmem[a-z_]*|"
                  r"cusparse|cusparseLt|cufft|cufftw|curand|cusolver|cusolverMg|cupti|nvToolsExt|nvtx3interop|cufile(_rdma)?)\.so")
maps = []
try:
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            maps.append(parts[5].strip().removesuffix(" (deleted)"))
except OSError:
    notes.append("no /proc/self/maps: the loaded libraries were not checked")
loaded = {}
for p in dict.fromkeys(maps):
    m = CUDA.match(os.path.basename(p))
    if m:
        loaded.setdefault(os.path.basename(p).split(".so")[0], set()).add(real(p))
for stem, paths in sorted(loaded.items()):
    if len(paths) > 1:
        problems.append(f"{stem} loaded {len(paths)} times: " + ", ".join(sorted(paths)))
    for p in sorted(paths):
        if not under(p, VENV):
            problems.append(f"{stem} loaded from {p}, outside the venv")

# 7. the run's fingerprint: its loaded CUDA libraries come from the venv, one copy each
folders = {}
if fingerprint:
    fp = json.load(open(fingerprint))
    for lib, entry in sorted((fp.get("cuda_libraries") or {}).items()):
        if not isinstance(entry, dict) or lib == "driver":
            continue
        for flag in ("multiple_copies_loaded", "mixed_folders"):
            if entry.get(flag):
                problems.append(f"fingerprint: {lib} {flag.replace('_', ' ')}: {entry[flag]}")
        files = entry.get("files")
        for base, info in (files.items() if isinstance(files, dict) else []):
            path = info.get("path") if isinstance(info, dict) else None
            if path:
                folders.setdefault(lib, set()).add(os.path.dirname(path))
                if not under(real(path), VENV) and not under(path, VENV):
                    problems.append(f"fingerprint: {lib} {base} loaded from {path}, outside the venv")

report = {"ok": not problems, "venv": VENV, "python": sys.executable, "ld_library_path": ld_path, "library_homes": homes, "flags": {"ignore_environment": sys.flags.ignore_environment,
          "no_user_site": sys.flags.no_user_site}, "sys_path": sys.path, "machine_torch": machine_torch or None,
          "modules_checked": sum(1 for m in sys.modules.values() if getattr(m, "__file__", None)),
          "distributions": len(have), "set_packages": len(want),
          "cuda_libraries_loaded": {k: sorted(v) for k, v in sorted(loaded.items())},
          "fingerprint": fingerprint or None, "fingerprint_library_folders": {k: sorted(v) for k, v in folders.items()},
          "problems": problems, "notes": notes}
with open(report_path, "w") as fh:
    json.dump(report, fh, indent=2)
for n in notes:
    print(f"note: {n}")
for p in problems:
    print(f"FAIL: {p}")
print(("isolation ok: " if not problems else "isolation FAILED: ") +
      f"{report['modules_checked']} modules, {len(have)} distributions ({len(want)} in the set), "
      f"{len(loaded)} CUDA libraries loaded{', fingerprint ' + fingerprint if fingerprint else ''}")
sys.exit(1 if problems else 0)
PY
}

case "$cmd" in
files)  # here or anywhere: what prepare fetches
  set_files
  ;;
prepare)  # here: every file of the set, hash-checked (the CUDA wheels the device image also has among them)
  SRC=${STAGE_SRC:-.whl/replay-$lock-src}
  mkdir -p "$SRC/wheels"
  set_files > "$SRC/set-files.txt" || exit 1
  "$PY" - "$SRC/set-files.txt" "$SRC/wheels" "${JOBS:-4}" <<'PY'
import hashlib, os, shutil, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
rows = [line.split() for line in open(sys.argv[1]) if line.strip()]
dest_dir = sys.argv[2]

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

def fetch(row):
    _, name, want, url = row
    dest = os.path.join(dest_dir, name)
    if os.path.exists(dest) and sha256(dest) == want:
        return None
    try:
        if "://" in url:
            with urllib.request.urlopen(url, timeout=180) as r, open(dest + ".part", "wb") as out:
                shutil.copyfileobj(r, out, 1 << 20)
        else:
            shutil.copyfile(url, dest + ".part")
    except OSError as exc:
        return f"{name}: not reachable from here ({url}): {exc}"
    got = sha256(dest + ".part")
    if got != want:
        os.unlink(dest + ".part")
        return f"{name}: sha256 {got}, the set pins {want}"
    os.replace(dest + ".part", dest)
    return None

with ThreadPoolExecutor(int(sys.argv[3])) as pool:
    failed = [e for e in pool.map(fetch, rows) if e]
for e in failed:
    print(e, file=sys.stderr)
size = sum(os.path.getsize(os.path.join(dest_dir, r[1])) for r in rows if os.path.exists(os.path.join(dest_dir, r[1])))
print(f"{len(rows) - len(failed)} of {len(rows)} files of {len({r[0] for r in rows})} packages in {dest_dir}, {size} bytes")
sys.exit(1 if failed else 0)
PY
  ;;
install)  # device: unpack the staged set, make the venv, install every wheel of the set into it
  mkdir -p "$WORK" "$RES"
  if [ ! -f "$SRC/set-files.txt" ]; then
    bash benchmarks/scripts/stage-gpu.sh unpack "$SRC" "$STAGE" || exit 1
    rm -rf "/tmp/stage-chunks/$(basename "$STAGE")"
  fi
  cmp -s "$SRC/set-files.txt" <(set_files) || { echo "$SRC holds another set than $PYLOCK: prepare and stage again" >&2; exit 1; }
  rm -rf "$VENV"
  if ! "$PY" -m venv --without-pip "$VENV"; then # a venv by hand: what `venv --without-pip` writes
    base=$("$PY" -c 'import sys; print(sys._base_executable)') && mkdir -p "$VENV/bin" && ln -s "$base" "$VENV/bin/python" \
      && printf 'home = %s\ninclude-system-site-packages = false\nversion = %s\n' "$(dirname "$base")" \
           "$("$PY" -c 'import platform; print(platform.python_version())')" > "$VENV/pyvenv.cfg" || exit 1
  fi
  "$PY" -m pip --python "$VENV/bin/python" --version > /dev/null \
    || { echo "the machine's pip cannot install into another interpreter (pip --python needs pip >= 22.3)" >&2; exit 1; }
  "$VENV/bin/python" -E -s -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || { echo "$VENV is not a venv" >&2; exit 1; }
  "$PY" "muse_stack/stack/pylock.py" requirements "$PYLOCK" --no-sdists > "$WORK/requirements.txt" || exit 1
  echo "installing $(wc -l < "$WORK/requirements.txt") packages of $PYLOCK into $VENV, hashes required" | tee "$RES/install.txt"
  "$PY" -m pip --python "$VENV/bin/python" install --no-index --no-deps --no-compile --require-hashes \
    --only-binary :all: --find-links "$SRC/wheels" -r "$WORK/requirements.txt" >> "$RES/install.txt" 2>&1 \
    || { tail -20 "$RES/install.txt"; ship; exit 1; }
  tail -2 "$RES/install.txt"; ship
  ;;
te)  # device: TE's PyTorch extension from the set's sdist (hash-checked), built against the venv's torch
  enter_env
  mkdir -p "$RES"
  archs=$(lock_value transformer_engine cuda_archs); ep=$(lock_value transformer_engine with_nccl_ep)
  "$PY" muse_stack/stack/pylock.py requirements "$PYLOCK" --only transformer-engine-torch --sdist transformer-engine-torch \
    > "$WORK/requirements-te.txt" || exit 1
  start=$(date +%s)
  # the Dockerfile's step: forced to build (no prebuilt download), for the lock's archs, with the
  # machine's nvcc (CUDA_HOME for the build only) and the set's cuDNN and NCCL headers
  CUDA_HOME=${BUILD_CUDA_HOME:-/usr/local/cuda} CUDA_PATH=${BUILD_CUDA_HOME:-/usr/local/cuda} \
  NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS="$archs" NVTE_WITH_NCCL_EP=$([ "$ep" = true ] && echo 1 || echo 0) \
  MAX_JOBS=${MAX_JOBS:-8} CPATH="$CUDNN_HOME/include:$NCCL_HOME/include" \
    "$PY" -m pip --python "$VENV/bin/python" install --no-index --no-deps --no-build-isolation --no-cache-dir \
      --require-hashes --no-binary transformer-engine-torch --find-links "$SRC/wheels" -r "$WORK/requirements-te.txt" \
      > "$RES/te-build.log" 2>&1 \
    || { tail -40 "$RES/te-build.log"; echo "TE PyTorch extension did not build for $archs"; ship; exit 1; }
  echo "TE PyTorch extension for NVTE_CUDA_ARCHS=$archs built in $(( $(date +%s) - start )) s" | tee -a "$RES/te-build.log"
  ship
  ;;
fa-fetch)  # here: the set's flash-attn sdist alone, hash-checked, for a machine whose replay venv is installed
  dir=.whl/replay-$lock-fa
  read -r url sum < <("$PY" muse_stack/stack/pylock.py sdist "$PYLOCK" flash-attn) || exit 1
  mkdir -p "$dir" && file="$dir/${url##*/}"
  if ! echo "$sum  $file" | sha256sum -c --quiet - >/dev/null 2>&1; then
    curl -fsSL --retry 3 -o "$file.part" "$url" || { echo "could not fetch $url" >&2; exit 1; }
    echo "$sum  $file.part" | sha256sum -c --quiet - || { rm -f "$file.part"; echo "$url does not hash to the set's $sum" >&2; exit 1; }
    mv "$file.part" "$file"
  fi
  echo "$file (sha256 $sum): carry $dir to the device (run's carry), then fa-start $lock there"
  ;;
fa-start)  # device: flash-attn from the set's sdist (hash-checked, -std patched as the image does), in the background
  enter_env
  # the lock's archs (components.flash_attn.cuda_archs; FA_ARCHS only to try another list)
  FA=$WORK/fa; archs=${FA_ARCHS:-$(lock_value flash_attn cuda_archs)}
  read -r url sum < <("$PY" muse_stack/stack/pylock.py sdist "$PYLOCK" flash-attn) || exit 1
  file="$SRC/wheels/${url##*/}"; [ -f "$file" ] || file=".whl/replay-$lock-fa/${url##*/}"  # fa-fetch's copy
  echo "$sum  $file" | sha256sum -c --quiet - || { echo "$file is not the set's flash-attn sdist (fa-fetch $lock here)" >&2; exit 1; }
  rm -rf "$FA" && mkdir -p "$FA/src" && tar -xzf "$file" -C "$FA/src" --strip-components=1 || exit 1
  "${VPY[@]}" containers/flash_attn_prepare.py patch "$FA/src" --torch "$SP/torch" || exit 1
  ls "$FA"/src/csrc/flash_attn/src/*.cu "$FA"/src/csrc/flash_attn/*.cpp 2>/dev/null | wc -l > "$FA/sources"
  # jobs as the image budgets them: the memory available over flash-attn's own estimate of a job's
  # (its setup.py: about 9 GB), at most the machine's cores (FA_JOBS to cap it lower)
  jobs=$("${VPY[@]}" containers/flash_attn_prepare.py jobs "$FA/src" --max "${FA_JOBS:-$(nproc)}") || exit 1
  # its own process session, so it outlives this call (the machine keeps it while warm); `run`
  # stops every process of that session (SIGSTOP; ninja puts each nvcc in a process group of its
  # own, so the session, not the group) while slice-1gpu is timed, and resumes them after
  CUDA_HOME=${BUILD_CUDA_HOME:-/usr/local/cuda} CUDA_PATH=${BUILD_CUDA_HOME:-/usr/local/cuda} \
  FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$archs" MAX_JOBS=$jobs \
    setsid nohup bash -c 'cd "$1" && echo $$ > sid && date +%s > start && nice -n 10 "$2" -m pip --python "$3" install \
      --no-index --no-deps --no-build-isolation --no-cache-dir ./src > build.log 2>&1; echo $? > rc' fa "$FA" "$PY" "$VENV/bin/python" \
    > /dev/null 2>&1 < /dev/null &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$FA/sid" ] && break; sleep 0.5; done
  [ -s "$FA/sid" ] || { echo "the flash-attn build did not start" >&2; exit 1; }
  echo "flash-attn $(basename "$file") building for FLASH_ATTN_CUDA_ARCHS=$archs with $jobs jobs in the background (session $(cat "$FA/sid")): poll with fa-status"
  ;;
fa-status)  # device: a short poll; once flash-attn is built, the selfcheck and audit are made again with it
  FA=$WORK/fa
  [ -f "$FA/sid" ] || { echo "flash-attn: no build started (fa-start); it stays unverified"; exit 0; }
  # FA_WAIT=S: wait up to S seconds for the build to end, with a line each minute (one long call
  # instead of many short ones: the machine counts as held either way)
  waited=0
  while [ ! -f "$FA/rc" ] && [ "$waited" -lt "${FA_WAIT:-0}" ]; do
    [ $((waited % 60)) = 0 ] && echo "flash-attn: $(find "$FA/src/build" -name '*.o' 2>/dev/null | wc -l) of $(cat "$FA/sources") objects after $(( $(date +%s) - $(cat "$FA/start") )) s"
    sleep 15; waited=$((waited + 15))
  done
  now=$(date +%s); start=$(cat "$FA/start" 2>/dev/null || echo "$now")
  done_objs=$(find "$FA/src/build" -name '*.o' 2>/dev/null | wc -l)
  if [ ! -f "$FA/rc" ]; then
    echo "flash-attn: building, $((now - start)) s, $done_objs of $(cat "$FA/sources") objects"; tail -c 400 "$FA/build.log"; exit 0
  fi
  mkdir -p "$RES"; cp "$FA/build.log" "$RES/fa-build.log"
  if [ "$(cat "$FA/rc")" != 0 ]; then
    echo "flash-attn did not build (exit $(cat "$FA/rc")) after $((now - start)) s: unverified"; tail -30 "$FA/build.log"; ship; exit 1
  fi
  echo "flash-attn built and installed in $(( $(stat -c %Y "$FA/rc") - start )) s" | tee "$RES/fa-built.txt"
  enter_env
  mkdir -p "$RES/flash-attn" && cp "$FA/build.log" "$RES/flash-attn/fa-build.log"
  "${VPY[@]}" benchmarks/scripts/flash_attn_check.py --lock "$lock" --out "$RES/flash-attn"
  echo "flash-attn check: exit $?"
  "${VPY[@]}" -m muse_stack.cli stack selfcheck "$lock" --image --json "$RES/selfcheck-with-fa.json" > "$RES/selfcheck-with-fa.txt" 2>&1
  echo "selfcheck with flash-attn: exit $?"; tail -4 "$RES/selfcheck-with-fa.txt"
  "${VPY[@]}" -m muse_stack.cli fingerprint -o "$RES/fingerprint-with-fa.json" > /dev/null 2>&1
  "${VPY[@]}" -m muse_stack.cli audit "$RES/fingerprint-with-fa.json" --recipe "$RECORD" --json > "$RES/audit-with-fa-$RECORD.json"
  echo "audit with flash-attn: exit $?"
  ship
  ;;
fa-check)  # device: flash-attn's machine code, and one forward and backward against torch's SDPA, in the venv
  enter_env
  mkdir -p "$RES/flash-attn"; [ -f "$WORK/fa/build.log" ] && cp "$WORK/fa/build.log" "$RES/flash-attn/fa-build.log"
  "${VPY[@]}" benchmarks/scripts/flash_attn_check.py --lock "$lock" --out "$RES/flash-attn"; rc=$?; ship; exit $rc
  ;;
isolation)  # any: the isolation proof alone (IMPORTS=a,b to choose modules; CHECK_GPU=0 on a CPU)
  enter_env
  isolation "${FINGERPRINT:-}"; rc=$?; ship; exit $rc
  ;;
check)  # device: the whole set against the lock, as an image is checked, then the isolation proof
  enter_env
  mkdir -p "$RES"
  "${VPY[@]}" -m muse_stack.cli stack selfcheck "$lock" --image --json "$RES/selfcheck.json" > "$RES/selfcheck.txt" 2>&1
  echo "selfcheck exit $?"; tail -6 "$RES/selfcheck.txt"
  isolation > "$RES/isolation.txt" 2>&1; echo "isolation exit $?"; tail -12 "$RES/isolation.txt"
  ship
  ;;
run)  # device: slice-1gpu as shipped, parity, and the comparisons against the record and the h200 run
  enter_env
  mkdir -p "$RES" runs
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  MS=("${VPY[@]}" -m muse_stack.cli)
  fa_pids() { [ -s "$WORK/fa/sid" ] && [ ! -f "$WORK/fa/rc" ] && ps -o pid= -s "$(cat "$WORK/fa/sid")"; }
  fa_signal() { # three passes: a process started by one not yet stopped is caught by the next
    local p n=0
    for _ in 1 2 3; do p=$(fa_pids) || return 1; kill -"$1" $p 2>/dev/null; n=$(echo $p | wc -w); sleep 0.2; done
    echo "flash-attn build: SIG$1 to its $n processes"
  }
  paused=; fa_signal STOP && paused=1
  rm -rf "runs/replay-$lock"
  timeout "${RUN_TIMEOUT:-300}" "${MS[@]}" run slice-1gpu --out "runs/replay-$lock" --no-progress > "$RES/run.log" 2>&1
  echo "run exit $?"; tail -4 "$RES/run.log"
  [ -n "$paused" ] && fa_signal CONT
  for f in results.json metrics.jsonl fingerprint.json recipe.yaml; do cp "runs/replay-$lock/$f" "$RES/" 2>/dev/null; done
  # the run's own loaded libraries are in its fingerprint: no second GPU exercise here
  CHECK_GPU=0 isolation "$RES/fingerprint.json" > "$RES/isolation-fingerprint.txt" 2>&1
  echo "isolation of the run's fingerprint exit $?"; tail -6 "$RES/isolation-fingerprint.txt"
  "${MS[@]}" audit "$RES/fingerprint.json" --recipe "$RECORD" --json > "$RES/audit-$RECORD.json"; echo "audit exit $?"
  "${MS[@]}" diff "$RES/fingerprint.json" "$AGAINST/fingerprint.json" --json > "$RES/diff-$(basename "$AGAINST").json"; echo "diff exit $?"
  "${MS[@]}" compare "$AGAINST" "runs/replay-$lock" --json --no-plot > "$RES/compare-$(basename "$AGAINST").json"; echo "compare exit $?"
  # the parity harness is the lab's (benchmarks/lab/verify/parity.py); -E ignores PYTHONPATH: its folder is added here
  timeout "${PARITY_TIMEOUT:-200}" "${VPY[@]}" -c 'import sys; sys.path.insert(1, "benchmarks"); from lab.verify.parity import main; sys.exit(main())' \
    --train-steps 3 --out "$RES/parity-tp1.json" \
    > "$RES/parity.log" 2>&1; echo "parity exit $?"; tail -3 "$RES/parity.log"
  "$PY" -m pip --python "$VENV/bin/python" list --format=json > "$RES/pip-list.json" 2>/dev/null
  ship
  ;;
*) echo "unknown command $cmd; $usage" >&2; exit 2 ;;
esac
