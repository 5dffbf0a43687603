"""benchmarks/scripts/replay.sh, the replay of a lock's wheel set on a machine with no registry, checked
on a CPU and offline: `prepare` fetches every package of the set (no skip list), `install` puts the set
into an isolated venv with hashes required, and `isolation` fails when anything outside that venv is
imported, is installed, or is loaded as a CUDA library.

The set here is two small wheels made by the test (one named like a CUDA library the old replay left
to the machine's image), listed in a PEP 751 file by local path, which `prepare` copies as it would
download a URL."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from muse_stack.stack import pylock

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scripts" / "replay.sh"
GPU_LOCKS = ["b200", "h200", "gb200"]


def replay(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    full.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=600)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize("lock", GPU_LOCKS)
def test_prepare_fetches_every_package_of_the_set(lock):
    path = ROOT / "containers" / "locks" / f"pylock.{lock}.toml"
    if not path.exists():
        pytest.skip(f"no wheel set for {lock}")
    doc, pkgs = pylock.load(path)
    res = replay("files", lock)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines()]
    listed: dict[str, set[str]] = {}
    for key, name, sha, url in rows:
        listed.setdefault(key, set()).add(sha)
        assert url.rsplit("/", 1)[-1] == name
    assert set(listed) == set(pkgs)  # no package left to the machine's image
    sdists = {pylock.canonical(n) for n in doc["tool"]["muse-stack"]["sdists"]}
    for key, pkg in pkgs.items():
        want = {pkg.sdist.sha256} if key in sdists else {w.sha256 for w in pkg.wheels}
        assert listed[key] == want, key
    # the CUDA libraries the old replay took from the machine's image are fetched like the rest
    for cuda in ("nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cufft", "nvidia-nvshmem-cu13"):
        assert cuda in listed


def test_install_and_te_steps_require_hashes_and_use_the_venv():
    text = SCRIPT.read_text()
    commands = text.replace("\\\n", " ").splitlines()  # continuation lines joined
    pip_installs = [line for line in commands if re.search(r"-m pip --python \S+ install ", line)]
    assert len(pip_installs) >= 3  # the set, TE's extension, flash-attn
    for line in pip_installs:
        assert '"$VENV/bin/python"' in line or '"$3"' in line
        assert "--no-index" in line
    set_and_te = [line for line in pip_installs if "--find-links" in line]
    assert len(set_and_te) == 2 and all("--require-hashes" in line for line in set_and_te)
    assert "on_device" not in text and "--target" not in text


# --- a tiny set, made here ------------------------------------------------------------------------

def _wheel(directory: Path, name: str, version: str, files: dict[str, str]) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    entries = dict(files)
    entries[f"{dist}.dist-info/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    entries[f"{dist}.dist-info/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for arc, body in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(body.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    entries[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, body in entries.items():
            zf.writestr(arc, body)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory):
    """A two-package set, prepared and installed by replay.sh into a venv: the environment of the
    isolation tests. Returns the paths and the environment the script runs with."""
    tmp = tmp_path_factory.mktemp("replay")
    origin = tmp / "origin"
    origin.mkdir()
    wheels = [
        ("tinypkg", "1.0", _wheel(origin, "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 1\n"})),
        ("nvidia-cuda-runtime", "13.0.96",
         _wheel(origin, "nvidia-cuda-runtime", "13.0.96", {"nvidia/cu13/lib/README": "the set's cudart\n"})),
    ]
    lines = ['lock-version = "1.0"', 'created-by = "test"']
    for name, version, path in wheels:
        lines += ["", "[[packages]]", f'name = "{name}"', f'version = "{version}"',
                  f'wheels = [{{ path = "{path}", hashes = {{ sha256 = "{_sha(path)}" }} }}]']
    (tmp / "pylock.test.toml").write_text("\n".join(lines) + "\n")
    machine = tmp / "machine"  # stands in for the machine's site-packages, with its own torch
    (machine / "torch").mkdir(parents=True)
    (machine / "torch" / "__init__.py").write_text("MACHINE = True\n")
    (machine / "leaky.py").write_text("LEAK = True\n")
    env = {"PY": sys.executable, "PYLOCK": str(tmp / "pylock.test.toml"), "VENV": str(tmp / "venv"),
           "WORK": str(tmp / "work"), "SRC": str(tmp / "src"), "STAGE_SRC": str(tmp / "src"), "OUT": str(tmp / "out"),
           "MACHINE_TORCH": str(machine / "torch"), "CHECK_GPU": "0", "IMPORTS": "tinypkg,json"}
    prepared = replay("prepare", "test", env=env)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    installed = replay("install", "test", env=env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    site = Path(subprocess.run([str(tmp / "venv" / "bin" / "python"), "-E", "-s", "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    return {"tmp": tmp, "env": env, "machine": machine, "site": site}


def test_prepare_and_install_put_every_package_in_the_venv(tiny_set):
    site = tiny_set["site"]
    assert (site / "tinypkg" / "__init__.py").exists()
    assert (site / "nvidia" / "cu13" / "lib" / "README").exists()  # the CUDA package, from the set too
    names = sorted(p.name for p in (tiny_set["tmp"] / "src" / "wheels").iterdir())
    assert names == ["nvidia_cuda_runtime-13.0.96-py3-none-any.whl", "tinypkg-1.0-py3-none-any.whl"]


def test_prepare_refuses_a_file_whose_hash_differs(tiny_set, tmp_path):
    text = Path(tiny_set["env"]["PYLOCK"]).read_text()
    bad = tmp_path / "pylock.test.toml"
    good = _sha(next((tiny_set["tmp"] / "origin").glob("tinypkg-*.whl")))
    bad.write_text(text.replace(good, "0" * 64))
    res = replay("prepare", "test", env={**tiny_set["env"], "PYLOCK": str(bad), "STAGE_SRC": str(tmp_path / "src")})
    assert res.returncode == 1
    assert f"tinypkg-1.0-py3-none-any.whl: sha256 {good}, the set pins {'0' * 64}" in res.stderr
    assert not (tmp_path / "src" / "wheels" / "tinypkg-1.0-py3-none-any.whl").exists()


def test_install_refuses_a_wheel_changed_after_prepare(tiny_set, tmp_path):
    env = dict(tiny_set["env"])
    src = tmp_path / "src"
    env.update({"STAGE_SRC": str(src), "SRC": str(src), "VENV": str(tmp_path / "venv"), "WORK": str(tmp_path / "work")})
    assert replay("prepare", "test", env=env).returncode == 0
    wheel = src / "wheels" / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("tinypkg/extra.py", "X = 2\n")
    res = replay("install", "test", env=env)
    assert res.returncode == 1
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in res.stdout + res.stderr


def isolation(tiny_set, **extra: str) -> subprocess.CompletedProcess:
    return replay("isolation", "test", env={**tiny_set["env"], **extra})


def test_isolation_passes_in_the_venv_and_ignores_pythonpath(tiny_set):
    # the machine's folder on PYTHONPATH changes nothing: the replay's python runs with -E -s
    res = isolation(tiny_set, PYTHONPATH=str(tiny_set["machine"]))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "isolation ok" in res.stdout
    report = json.loads((tiny_set["tmp"] / "work" / "out" / "isolation.json").read_text())
    assert report["ok"] and report["flags"] == {"ignore_environment": 1, "no_user_site": 1}
    assert report["distributions"] == report["set_packages"] == 2
    # the set's CUDA library folder first on the loader's path; TE's library homes in the venv
    assert report["ld_library_path"][0] == str(tiny_set["site"] / "nvidia" / "cu13" / "lib")
    assert report["library_homes"]["NVRTC_HOME"] == str(tiny_set["site"] / "nvidia" / "cu13")
    assert report["library_homes"]["CUDNN_HOME"] == str(tiny_set["site"] / "nvidia" / "cudnn")


def shell_commands() -> list[str]:
    """The script's shell lines, continuation lines joined, without comments and the bodies of its
    Python here-documents."""
    out, in_heredoc = [], False
    for line in SCRIPT.read_text().replace("\\\n", " ").splitlines():
        if in_heredoc:
            in_heredoc = line.strip() != "PY"
            continue
        in_heredoc = "<<'PY'" in line
        if not line.lstrip().startswith("#"):
            out.append(line)
    return out


def test_every_replay_python_is_the_venvs():
    runs = [line for line in shell_commands()
            if re.search(r"muse_stack\.|lab\.verify|flash_attn_prepare|\$\{MS\[@\]\}", line)]
    # selfcheck (twice), fingerprint, audit (twice), diff, compare, slice-1gpu, parity, the sdist patch
    assert len(runs) >= 10
    for line in runs:
        assert '"${VPY[@]}"' in line or '"${MS[@]}"' in line, line


@pytest.fixture
def leak(tiny_set):
    """The machine's folder made importable from inside the venv (a .pth file), as a venv made with
    system site-packages would."""
    pth = tiny_set["site"] / "machine-leak.pth"
    pth.write_text(str(tiny_set["machine"]) + "\n")
    yield
    pth.unlink()


def test_isolation_fails_on_a_module_imported_from_outside_the_venv(tiny_set, leak):
    res = isolation(tiny_set, IMPORTS="tinypkg,leaky")
    assert res.returncode == 1
    assert f"FAIL: module leaky imported from {tiny_set['machine'] / 'leaky.py'}, outside the venv" in res.stdout
    assert f"FAIL: sys.path holds '{tiny_set['machine']}'" in res.stdout


def test_isolation_fails_when_the_machines_torch_is_reachable(tiny_set, leak):
    res = isolation(tiny_set)  # torch itself not imported: found is enough
    assert res.returncode == 1
    assert f"torch resolves to {tiny_set['machine'] / 'torch' / '__init__.py'}, outside the venv" in res.stdout
    assert "without the venv, torch is still found" in res.stdout


def test_isolation_fails_on_a_distribution_outside_the_set(tiny_set):
    extra = tiny_set["site"] / "stray-2.0.dist-info"
    extra.mkdir()
    (extra / "METADATA").write_text("Metadata-Version: 2.1\nName: stray\nVersion: 2.0\n")
    try:
        res = isolation(tiny_set)
    finally:
        (extra / "METADATA").unlink()
        extra.rmdir()
    assert res.returncode == 1
    assert "FAIL: installed outside the set: stray 2.0" in res.stdout


def _fingerprint(path: Path, files: dict[str, str], **flags) -> Path:
    entry = {"files": {os.path.basename(p): {"path": p} for p in files.values()}, **flags}
    path.write_text(json.dumps({"cuda_libraries": {
        "cuda_runtime": entry, "driver": {"files": {"libcuda.so.1": {"path": "/usr/local/nvidia/lib64/libcuda.so.1"}}}}}))
    return path


def test_isolation_checks_the_runs_loaded_libraries(tiny_set, tmp_path):
    lib = tiny_set["site"] / "nvidia" / "cu13" / "lib"
    inside = _fingerprint(tmp_path / "in.json", {"a": str(lib / "libcudart.so.13")})
    assert isolation(tiny_set, FINGERPRINT=str(inside)).returncode == 0
    machine = "/usr/local/cuda-13.0/targets/x86_64-linux/lib/libcudart.so.13.0.96"
    twice = _fingerprint(tmp_path / "twice.json", {"a": str(lib / "libcudart.so.13"), "b": machine},
                         multiple_copies_loaded=["libcudart"])
    res = isolation(tiny_set, FINGERPRINT=str(twice))
    assert res.returncode == 1
    assert "FAIL: fingerprint: cuda_runtime multiple copies loaded: ['libcudart']" in res.stdout
    assert f"FAIL: fingerprint: cuda_runtime libcudart.so.13.0.96 loaded from {machine}, outside the venv" in res.stdout


def test_a_distribution_vendored_inside_a_package_of_the_set_is_part_of_it(tiny_set):
    # setuptools appends its _vendor folder to sys.path when imported: the dist-infos there are
    # found beside the set's. They belong to the package that carries them; the same dist-info
    # loose in site-packages is a distribution outside the set.
    vendor = tiny_set["site"] / "tinypkg" / "_vendor"
    info = vendor / "stowaway-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stowaway\nVersion: 1.0\n")
    pth = tiny_set["site"] / "vendor-on-path.pth"
    pth.write_text(str(vendor) + "\n")
    try:
        res = isolation(tiny_set)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "note: stowaway 1.0 is vendored inside the set's tinypkg" in res.stdout
        loose = tiny_set["site"] / "stowaway-1.0.dist-info"
        info.rename(loose)
        try:
            res = isolation(tiny_set)
        finally:
            loose.rename(info)
        assert res.returncode == 1
        assert "FAIL: installed outside the set: stowaway 1.0" in res.stdout
    finally:
        pth.unlink()
        shutil.rmtree(vendor)


DEBIAN_PYTHON = Path("/usr/bin/python3.11")


@pytest.mark.skipif(not (DEBIAN_PYTHON.exists() and Path("/usr/lib/python3.11/sitecustomize.py").is_symlink()),
                    reason="needs Debian's python3.11, whose standard library's sitecustomize.py links into /etc")
def test_the_base_interpreters_own_linked_sitecustomize_is_its_standard_library(tiny_set, tmp_path):
    # Debian's (and Ubuntu's, the lent machine's) standard library holds sitecustomize.py as a link
    # to /etc/python3.X/sitecustomize.py; every interpreter imports it at start. It is the base
    # interpreter's own file, imported by the path in its standard library folder.
    venv = tmp_path / "venv"
    subprocess.run([str(DEBIAN_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = venv / "lib" / "python3.11" / "site-packages"
    assert tiny_set["site"].parent.name == "python3.11", "the set's venv and this one share the minor version"
    shutil.copytree(tiny_set["site"], site, dirs_exist_ok=True)
    res = isolation(tiny_set, VENV=str(venv))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tiny_set["tmp"] / "work" / "out" / "isolation.json").read_text())
    assert report["ok"] and "sitecustomize" not in json.dumps(report["problems"])
    # a module from a dist-packages folder outside the venv still fails in this venv
    leak_dir = tmp_path / "dist-packages"
    leak_dir.mkdir()
    (leak_dir / "elsewhere.py").write_text("Y = 1\n")
    (site / "leak.pth").write_text(str(leak_dir) + "\n")
    res = isolation(tiny_set, VENV=str(venv), IMPORTS="tinypkg,elsewhere")
    assert res.returncode == 1
    assert f"FAIL: module elsewhere imported from {leak_dir / 'elsewhere.py'}, outside the venv" in res.stdout
