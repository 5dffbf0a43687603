"""The ways the GPU image build used to fail or drift, each caught: DeepEP is a wheel, flash-attn is
patched to torch's C++ standard, nothing installed after the wheel set can replace a package of it
(cuDNN 9.22 stays), TE's extension is always compiled, MAX_JOBS is a build argument, the build ends
in a self-check, and `make image` refuses bad input before any download."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path


from image_helpers import dockerfile_runs
from muse_stack.stack import pylock, selfcheck, wheelset
from muse_stack.stack.lock import load
from muse_stack.stack.preflight import builder_platforms, problems

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
LOCK_ENV = ROOT / "containers" / "lock-env.sh"
GPU = ["gb200", "b200", "h200"]


RUNS = dockerfile_runs(DOCKERFILE)


def test_only_the_sets_sdists_are_compiled_and_deepep_comes_as_a_wheel():
    # sgl-deep-ep publishes wheels only: a --no-binary install of it cannot work
    assert "--no-binary" not in DOCKERFILE
    compiled = re.findall(r"lock-env (?:install-sdist|fetch-sdist) \"\$\{(\w+)\}\"", DOCKERFILE)
    assert sorted(compiled) == ["FLASH_ATTN_PACKAGE", "TE_TORCH_PACKAGE"]
    for t in GPU:
        lk = load(t)
        pkgs = wheelset.check(lk).packages
        dep = pkgs[pylock.canonical(lk.lock.components.deepep.package)]
        assert dep.wheels, t
        for key in wheelset.sdist_packages(lk):
            assert pkgs[key].sdist is not None, (t, key)


def test_flash_attn_is_patched_to_torchs_standard_before_it_is_built():
    (run,) = [r for r in RUNS if "fetch-sdist \"${FLASH_ATTN_PACKAGE}\"" in r]
    patch = run.index("flash_attn_prepare.py patch /tmp/fa/src --torch")
    build = run.index("pip-install --no-build-isolation --no-deps /tmp/fa/src")
    assert patch < build
    # its jobs: tests/system/test_flash_attn_prepare.py (its own estimate of a job's memory)
    assert 'FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}"' in run and 'MAX_JOBS="${fa_jobs}"' in run
    assert (ROOT / "containers" / "flash_attn_prepare.py").is_file()


def test_te_extension_is_always_compiled_and_max_jobs_is_a_build_argument():
    (run,) = [r for r in RUNS if "install-sdist \"${TE_TORCH_PACKAGE}\"" in r]
    assert "NVTE_PYTORCH_FORCE_BUILD=TRUE" in run
    assert re.search(r"^ARG MAX_JOBS=\d+$", DOCKERFILE, re.M)
    assert "MAX_JOBS:-" not in DOCKERFILE  # no value fixed inside a RUN


def test_nothing_after_the_wheel_set_resolves_dependencies():
    """Every pip install in the build either installs the hash-pinned set itself or takes
    --no-deps: a later install cannot put torch's own cuDNN 9.24.0.43 back over 9.22.0.52."""
    for run in RUNS:
        for m in re.finditer(r"pip[ -]install[^&;]*", run):
            assert "--no-deps" in m.group(0), run
        # `lock-env pip-install install ...` once installed the registry's package "install"
        assert not re.search(r"pip[ -]install install\b", run), run
    text = LOCK_ENV.read_text()
    (install_set,) = re.findall(r"install-set\)\n(.*?);;", text, re.S)
    assert "--require-hashes --no-deps --only-binary :all:" in install_set
    for m in re.finditer(r"python -m pip install[^\n]*(?:\\\n[^\n]*)*", text):
        block = m.group(0)
        assert "--no-deps" in block or '"$@"' in block, block


def test_the_build_ends_in_the_selfcheck():
    idx = [i for i, r in enumerate(RUNS) if "stack selfcheck \"${LOCK_NAME}\" --image" in r]
    assert len(idx) == 1
    last_install = max(i for i, r in enumerate(RUNS) if re.search(r"pip[ -]install|install-set|install-sdist", r))
    assert idx[0] > last_install
    # and the loader sees the set's cuDNN first (TE reads CUDNN_HOME before /usr/local/cuda)
    assert "CUDNN_HOME=/opt/muse-stack/cuda-libs/cudnn" in DOCKERFILE
    assert re.search(r"LD_LIBRARY_PATH=/opt/muse-stack/cuda-libs/cuda/lib:/opt/muse-stack/cuda-libs/cudnn/lib:", DOCKERFILE)
    # and NVRTC and cuRAND from the set, not from the base's toolkit under CUDA_HOME (TE reads the
    # *_HOME variables first: the earlier replay loaded NVRTC twice without them)
    for var in ("NVRTC_HOME", "CURAND_HOME"):
        assert f"{var}=/opt/muse-stack/cuda-libs/cuda" in DOCKERFILE


def _fake_site(tmp_path, libs):
    """A site-packages with the set's nvidia/ folders holding the named libraries."""
    site = tmp_path / "site"
    for folder, name in libs:
        (site / "nvidia" / folder / "lib").mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / folder / "lib" / name).write_bytes(b"")
    return site


def _link_libs(tmp_path, site):
    import subprocess
    import sys

    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "python").write_text(f"#!/bin/sh\nexec {sys.executable} -c \"print('{site}')\"\n")
    (shim / "python").chmod(0o755)
    env = {"PATH": f"{shim}:/usr/bin:/bin"}
    return subprocess.run(["sh", str(LOCK_ENV), "link-libs", str(tmp_path / "cuda-libs")], env=env,
                          capture_output=True, text=True)


def test_link_libs_points_the_library_homes_at_the_set(tmp_path):
    site = _fake_site(tmp_path, [("cudnn", "libcudnn.so.9"), ("nccl", "libnccl.so.2"),
                                 ("cu13", "libnvrtc.so.13"), ("cu13", "libcurand.so.10")])
    r = _link_libs(tmp_path, site)
    assert r.returncode == 0, r.stderr
    for link, folder in (("cudnn", "cudnn"), ("nccl", "nccl"), ("cuda", "cu13")):
        assert (tmp_path / "cuda-libs" / link).resolve() == (site / "nvidia" / folder).resolve()


def test_link_libs_refuses_a_set_without_nvrtc(tmp_path):
    site = _fake_site(tmp_path, [("cudnn", "libcudnn.so.9"), ("nccl", "libnccl.so.2"), ("cu13", "libcurand.so.10")])
    r = _link_libs(tmp_path, site)
    assert r.returncode != 0 and "libnvrtc.so" in r.stderr


def test_selfcheck_catches_a_replaced_cudnn(monkeypatch):
    lk = load("b200")
    installed = {k: p.version for k, p in wheelset.check(lk).packages.items()}
    installed["nvidia-cudnn-cu13"] = "9.24.0.43"  # what torch 2.14.1's metadata would install
    items, _ = selfcheck.wheel_set(lk, installed, image=True)
    bad = [i for i in items if not i.ok]
    assert [(i.what, i.want, i.got) for i in bad] == [("nvidia-cudnn-cu13", "9.22.0.52", "9.24.0.43")]


def test_selfcheck_in_an_image_refuses_packages_outside_the_set():
    lk = load("cpu")
    installed = {k: p.version for k, p in wheelset.check(lk).packages.items()}
    installed.update({"pip": "25", "muse-stack": "0.1.0", "left-over": "1.0"})
    items, extra = selfcheck.wheel_set(lk, installed, image=True)
    assert extra == ["left-over"]
    assert [i.what for i in items if not i.ok] == ["nothing installed outside the set"]


def _stub(tmp_path: Path, name: str, body: str) -> None:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_lock_env_installs_the_whole_set_with_hashes_and_without_its_sdists(tmp_path):
    lk = load("b200")
    _stub(tmp_path, "python", f'echo "$@" > {tmp_path}/args; cp "$6" {tmp_path}/req.txt 2>/dev/null; '
                              f'for a; do case "$a" in *.txt) cp "$a" {tmp_path}/req.txt;; esac; done')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
           "MUSE_STACK_WHEELSET": str(wheelset.set_path(lk)),
           "MUSE_STACK_PYLOCK": str(ROOT / "muse_stack" / "stack" / "pylock.py")}
    subprocess.run(["sh", str(LOCK_ENV), "install-set", "", "https://pypi.org/simple"], env=env, check=True,
                   capture_output=True)
    args = (tmp_path / "args").read_text()
    assert "--require-hashes --no-deps --only-binary :all:" in args and "--extra-index-url https://pypi.org/simple" in args
    lines = (tmp_path / "req.txt").read_text().splitlines()
    names = {pylock.canonical(line.split("==")[0]) for line in lines}
    pkgs = wheelset.check(lk).packages
    assert names == set(pkgs) - set(wheelset.sdist_packages(lk))
    assert all("--hash=sha256:" in line for line in lines)
    assert any(line.startswith("nvidia-cudnn-cu13==9.22.0.52 ") for line in lines)


# --- make image: one refusal before any download ------------------------------------------------


def _unpinned(tmp_path: Path, name: str = "b200") -> Path:
    """A copy of a GPU lock (and its wheel set) with the base digest and EFA checksum left null."""
    text = (ROOT / "containers" / "locks" / f"{name}.toml").read_text()
    text = re.sub(r'^digest = "sha256:[0-9a-f]+"\n', 'digest = { null = "not resolved in this copy" }\n', text, flags=re.M)
    text = re.sub(r'^installer_sha256 = "[0-9a-f]+"\n', 'installer_sha256 = { null = "not resolved in this copy" }\n',
                  text, flags=re.M)
    text = re.sub(r'^(digest|installer_sha256)_sources = \[\n(?:  .*\n)*\]\n', "", text, flags=re.M)
    d = tmp_path / "locks"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(text)
    (d / f"pylock.{name}.toml").write_text((ROOT / "containers" / "locks" / f"pylock.{name}.toml").read_text())
    return d / f"{name}.toml"


def test_preflight_lists_every_problem_with_its_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker, no podman
    monkeypatch.delenv("BASE_DIGEST", raising=False)
    found = problems(load(_unpinned(tmp_path)), "docker")
    text = "\n".join(p for p, _ in found)
    assert "base.digest is not pinned" in text
    assert "components.efa.installer_sha256 is not pinned" in text
    assert "`docker` is not on PATH" in text
    fixes = "\n".join(f for _, f in found)
    assert "make pins gpu=b200" in fixes and "skopeo inspect --raw" in fixes and "curl -fsSL URL | sha256sum" in fixes
    # the committed locks have both pins: only the missing tool is left
    assert [p for p, _ in problems(load("b200"), "docker")] == ["`docker` is not on PATH"]
    assert problems(load("b200"), "kaniko")[0][0].startswith("ENGINE=kaniko")


def test_preflight_refuses_a_builder_without_the_locks_platform(tmp_path, monkeypatch):
    _stub(tmp_path, "docker", 'case "$2" in version) echo "buildx v0.20";; inspect) '
                              'printf "Name: default\\nPlatforms: linux/amd64, linux/amd64/v2\\n";; esac')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    plats, _ = builder_platforms("docker")
    assert plats == {"linux/amd64", "linux/amd64/v2"}
    gb = "\n".join(p for p, _ in problems(load("gb200"), "docker"))
    assert "cannot produce linux/arm64" in gb
    assert "cannot produce" not in "\n".join(p for p, _ in problems(load("h200"), "docker"))


def test_podman_platforms_come_from_the_machine_and_binfmt(tmp_path):
    (tmp_path / "qemu-aarch64").write_text("enabled\n")
    plats, how = builder_platforms("podman", binfmt_dir=tmp_path)
    assert "linux/arm64" in plats and "binfmt" in how


def test_make_image_refuses_before_any_download(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PY": str(Path(os.sys.executable)),
           "ENGINE": "docker"}
    env.pop("BASE_DIGEST", None)
    _stub(tmp_path, "docker", f'echo called >> {tmp_path}/docker-called; exit 1')
    lock = _unpinned(tmp_path)
    proc = subprocess.run(["bash", "containers/build-image.sh", str(lock)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert "refused before any download" in proc.stderr and "base.digest" in proc.stderr
    calls = (tmp_path / "docker-called").read_text().splitlines() if (tmp_path / "docker-called").exists() else []
    assert len(calls) <= 1  # at most the buildx probe; never a build or pull
    # and without the project environment, the message says how to make it
    proc = subprocess.run(["bash", "containers/build-image.sh", "b200"], cwd=ROOT, env={**env, "PY": "/nonexistent/python"},
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "run make setup" in proc.stderr


def _image_set_library_path() -> str:
    """The set part of the image's LD_LIBRARY_PATH: the ENV that the install step checks."""
    return re.search(r"\n\s+LD_LIBRARY_PATH=(/opt/muse-stack/cuda-libs/\S+)\n", DOCKERFILE).group(1)


def _lock_env(*args: str, env: dict | None = None):
    import subprocess

    return subprocess.run(["sh", str(LOCK_ENV), *args], capture_output=True, text=True, env=env)


def test_the_images_library_path_is_the_replays(tmp_path):
    """The image's loader path is the replay's, folder for folder and in the same order, so the replay's
    proof that every mapped CUDA library is the set's, one file each, holds for the image: both are
    `lock-env lib-path` (the set's nvidia/ in the replay, link-libs' links to it in the image), and the
    Dockerfile's ENV is what that gives for the folders the b200 replay mapped (its committed self-check)."""
    import json
    import os

    replayed = json.loads((ROOT / "benchmarks/results/replay-b200-isolated/selfcheck.json").read_text())["ld_library_path"]
    names = [Path(p).parent.name for p in replayed.split(":") if "/site-packages/nvidia/" in p]
    assert names == sorted(names) and {"cudnn", "nccl"} <= set(names) and any(n.startswith("cu1") for n in names)
    libs = {"cudnn": "libcudnn.so.9", "nccl": "libnccl.so.2"}
    cuda = next(n for n in names if n.startswith("cu1"))
    site = _fake_site(tmp_path, [(n, libs.get(n, "libx.so")) for n in names]
                      + [(cuda, "libnvrtc.so.13"), (cuda, "libcurand.so.10")])
    (site / "nvidia" / "__init__.py").write_text("")  # not a library folder
    assert _link_libs(tmp_path, site).returncode == 0
    replay = _lock_env("lib-path", str(site / "nvidia"))
    image = _lock_env("lib-path", str(tmp_path / "cuda-libs"))
    assert replay.returncode == image.returncode == 0, replay.stderr + image.stderr
    replay_path, image_path = replay.stdout.strip().split(":"), image.stdout.strip().split(":")
    assert [Path(p).parent.name for p in replay_path] == names
    assert [os.path.realpath(p) for p in image_path] == [os.path.realpath(p) for p in replay_path]
    # the Dockerfile's ENV is that path, and the install step's check passes it and refuses any other
    env_path = _image_set_library_path().replace("/opt/muse-stack/cuda-libs", str(tmp_path / "cuda-libs"))
    assert env_path == image.stdout.strip()
    assert _lock_env("lib-path-check", str(tmp_path / "cuda-libs"), env_path + ":/opt/muse-stack/efa/x").returncode == 0
    short = ":".join(p for p in env_path.split(":") if "/cudnn/" in p or "/nccl/" in p)
    bad = _lock_env("lib-path-check", str(tmp_path / "cuda-libs"), short)
    assert bad.returncode != 0 and "does not start with the set's library folders" in bad.stderr
    # the replay script takes its path from the same definition
    assert 'containers/lock-env.sh lib-path "$SP/nvidia"' in (ROOT / "benchmarks/scripts/replay.sh").read_text()
