"""The image's entrypoint and EFA layer as a cluster user meets them: the entrypoint never puts the
driver's system folder ahead of the set's cuDNN and NCCL, and runs with only what the Nix image
carries (no sed); the EFA plugin is found in the multiarch folder the installer uses on Ubuntu,
NCCL is told to load it, and the Dockerfile itself refuses a build without the lock's digest or
the installer's checksum."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from image_helpers import dockerfile_runs
from muse_stack.stack import build_args, load

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "containers" / "entrypoint.sh"
LOCK_ENV = ROOT / "containers" / "lock-env.sh"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
FLAKE = (ROOT / "flake.nix").read_text()


RUNS = dockerfile_runs(DOCKERFILE)


def _fake_muse_stack(d: Path) -> None:
    f = d / "muse-stack"
    f.write_text('#!/bin/sh\necho "muse-stack $*"\necho "LD=${LD_LIBRARY_PATH:-}"\n')
    f.chmod(0o755)


# --- defect 3: the driver's folder never comes before the set ---------------------------------------


def test_entrypoint_as_uid_1000_appends_the_driver_folder_after_the_sets_libraries(tmp_path):
    driver = tmp_path / "usr-lib-triplet"
    driver.mkdir()
    (driver / "libcuda.so.1").write_text("")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # /run/opengl-driver cannot be made (as for uid 1000 in the image)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_muse_stack(bindir)
    the_set = "/opt/muse-stack/cuda-libs/cudnn/lib:/opt/muse-stack/cuda-libs/nccl/lib"
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "LD_LIBRARY_PATH": the_set,
           "MUSE_STACK_DRIVER_DIRS": str(driver), "MUSE_STACK_OPENGL_DRIVER": str(blocker / "opengl-driver"),
           "MUSE_STACK_MOUNTINFO": "/nonexistent"}
    r = subprocess.run(["sh", str(ENTRYPOINT), "list"], capture_output=True, text=True, env=env, check=True)
    ld = r.stdout.splitlines()[1].removeprefix("LD=").split(":")
    assert ld == the_set.split(":") + [str(driver)], ld
    # a second pass (the variable already carries the folder) adds nothing
    env["LD_LIBRARY_PATH"] = ":".join(ld)
    r = subprocess.run(["sh", str(ENTRYPOINT), "list"], capture_output=True, text=True, env=env, check=True)
    assert r.stdout.splitlines()[1].removeprefix("LD=").split(":") == ld
    # where the link can be made (root), it is made and the variable is left alone
    opengl = tmp_path / "opengl-driver"
    env.update(LD_LIBRARY_PATH=the_set, MUSE_STACK_OPENGL_DRIVER=str(opengl))
    r = subprocess.run(["sh", str(ENTRYPOINT), "list"], capture_output=True, text=True, env=env, check=True)
    assert r.stdout.splitlines()[1] == "LD=" + the_set
    assert (opengl / "lib").resolve() == driver.resolve()


def test_the_gpu_image_purges_the_bases_apt_nccl_and_checks_none_is_left():
    run = next(r for r in RUNS if "install-set" in r and "stack-gpu" not in r and "CUDNN_PURGE_APT" in r)
    assert "apt-get purge -y --allow-change-held-packages 'libnccl2' 'libnccl-dev'" in run
    assert "ldconfig -p | grep -q 'libnccl\\.so'" in run
    # purged before the set is installed and linked
    assert run.index("libnccl2") < run.index("lock-env install-set")


# --- defect 4: the entrypoint runs with the Nix image's tools only ------------------------------------

# what the Nix image's `contents` put on PATH besides the venv: bash, coreutils, grep, gawk
_NIX_TOOLS = ["bash", "sh", "awk", "grep"] + (
    "basename cat chmod cp cut date dirname echo env false head id ln ls mkdir mktemp mv printf pwd readlink "
    "realpath rm rmdir sleep sort tail tee test touch tr true uname wc [").split()


def test_the_nix_image_contents_are_the_tools_this_test_gives():
    contents = re.search(r"contents = \[([^\]]*)\]", FLAKE).group(1)
    assert "pkgs.gnused" not in contents and "sed" not in contents.replace("pkgs.", " ").split()
    for pkg in ("pkgs.bashInteractive", "pkgs.coreutils", "pkgs.gnugrep", "pkgs.gawk"):
        assert pkg in contents


@pytest.mark.parametrize("mountinfo_line, expect", [
    ("40 36 8:1 /home/u/my\\040runs /workspace/runs rw,relatime - ext4 /dev/nvme0n1p2 rw",
     "mounted from the host's /home/u/my runs (on /dev/nvme0n1p2)"),
    (None, "is not a mounted folder"),
])
def test_entrypoint_runs_a_recipe_with_only_the_nix_images_tools(tmp_path, mountinfo_line, expect):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in _NIX_TOOLS:
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    assert not (bindir / "sed").exists()
    _fake_muse_stack(bindir)
    info = tmp_path / "mountinfo"
    info.write_text("36 25 0:32 / / rw,relatime - overlay overlay rw\n" + (mountinfo_line + "\n" if mountinfo_line else ""))
    env = {"PATH": str(bindir), "MUSE_STACK_MOUNTINFO": str(info), "MUSE_STACK_DRIVER_DIRS": str(tmp_path / "none"),
           "MUSE_STACK_OPENGL_DRIVER": str(tmp_path / "opengl")}
    r = subprocess.run([str(bindir / "sh"), str(ENTRYPOINT), "run", "sft-192"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.splitlines()[0] == "muse-stack run sft-192"
    assert expect in r.stderr, r.stderr


# --- defect 6: EFA plugin folder and NCCL_NET_PLUGIN ---------------------------------------------------


def _sh_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}"}


@pytest.mark.parametrize("plugin_dir, fabric_dir", [
    ("ofi-nccl/lib/x86_64-linux-gnu", "efa/lib"),          # Ubuntu, non-NGC: the multiarch folder
    ("ofi-nccl/lib/aarch64-linux-gnu", "efa/lib"),
    ("ofi-nccl/lib", "efa/lib64"),                          # NGC bases and RPM systems
])
def test_efa_links_find_the_plugin_wherever_the_installer_put_it(tmp_path, plugin_dir, fabric_dir):
    root = tmp_path / "opt-amazon"
    (root / plugin_dir).mkdir(parents=True)
    (root / plugin_dir / "libnccl-net-ofi.so").write_text("")
    (root / plugin_dir / "libnccl-net.so").symlink_to("libnccl-net-ofi.so")  # the installer's default name
    (root / fabric_dir).mkdir(parents=True)
    (root / fabric_dir / "libfabric.so.1").write_text("")
    out = tmp_path / "efa"
    subprocess.run(["sh", str(LOCK_ENV), "efa-links", str(root), str(out)], check=True, capture_output=True,
                   env=_sh_env(tmp_path))
    assert (out / "ofi-nccl-lib" / "libnccl-net-ofi.so").exists()
    assert (out / "ofi-nccl-lib" / "libnccl-net-ofi.so").resolve() == (root / plugin_dir / "libnccl-net-ofi.so").resolve()
    # NCCL loads libnccl-net.so whenever its search finds one: the folder on the image's library path
    # holds the plugin under its own name only, so it loads where NCCL_NET_PLUGIN=ofi asks for it
    assert sorted(p.name for p in (out / "ofi-nccl-lib").iterdir()) == ["libnccl-net-ofi.so"]
    assert (out / "libfabric-lib").resolve() == (root / fabric_dir).resolve()


def test_efa_links_refuse_when_the_plugin_is_missing(tmp_path):
    root = tmp_path / "opt-amazon"
    (root / "efa" / "lib").mkdir(parents=True)
    r = subprocess.run(["sh", str(LOCK_ENV), "efa-links", str(root), str(tmp_path / "efa")], capture_output=True,
                       text=True, env=_sh_env(tmp_path))
    assert r.returncode != 0 and "no libnccl-net-ofi.so" in r.stderr


def test_the_image_finds_the_efa_plugin_in_the_linked_folders_but_does_not_ask_for_it():
    # the plugin is opt-in (loaded on InfiniBand hosts it slows NCCL down): no ENV of the image names
    # it; the launcher sets NCCL_NET_PLUGIN=ofi for machines whose fabric is EFA
    assert not [i for i in DOCKERFILE.split("\nENV ") if "NCCL_NET_PLUGIN" in i.split("\n\n")[0]]
    env_lines = [i for i in DOCKERFILE.split("\nENV ") if i.startswith("LD_LIBRARY_PATH=")]
    assert len(env_lines) == 1
    block = env_lines[0]
    ld = re.search(r"LD_LIBRARY_PATH=(\S+)", block).group(1).split(":")
    # the set first (its library path, set before: test_image_build_rules.py), then the EFA folders the
    # build linked; no flat /opt/amazon/ofi-nccl/lib guess
    assert ld == ["${LD_LIBRARY_PATH}", "/opt/muse-stack/efa/ofi-nccl-lib", "/opt/muse-stack/efa/libfabric-lib"]
    assert DOCKERFILE.index("LD_LIBRARY_PATH=/opt/muse-stack/cuda-libs/") < DOCKERFILE.index("\nENV " + block)
    efa_run = next(r for r in RUNS if "efa_installer.sh" in r)
    assert "lock-env efa-links /opt/amazon /opt/muse-stack/efa" in efa_run
    # nor does the dynamic linker's cache find the installer's libnccl-net.so (its ld.so.conf.d entry)
    assert "grep -ls ofi-nccl /etc/ld.so.conf.d/* | xargs -r rm -f; ldconfig" in efa_run


# --- defect 7: the Dockerfile refuses unpinned builds itself ---------------------------------------------


def _digest_guard() -> str:
    run = next(r for r in RUNS if "BASE_DIGEST:?" in r)
    return run.removeprefix("RUN ").strip()


@pytest.mark.parametrize("target", ["b200", "h200", "gb200"])
def test_the_dockerfile_refuses_a_base_not_pulled_by_the_locks_digest(target):
    args = build_args(load(target))
    guard = _digest_guard()
    ok = subprocess.run(["sh", "-c", guard], env={"PATH": os.environ["PATH"], "BASE_DIGEST": args["BASE_DIGEST"],
                                                 "BASE_REF": args["BASE_REF"]}, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    tag_ref = f"{args['BASE_IMAGE']}:{args['BASE_TAG']}"
    for env, says in (({"BASE_DIGEST": "", "BASE_REF": tag_ref}, "make pins gpu=TARGET"),
                      ({"BASE_DIGEST": args["BASE_DIGEST"], "BASE_REF": tag_ref}, "is not pulled by the lock's digest")):
        r = subprocess.run(["sh", "-c", guard], env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)
        assert r.returncode != 0 and says in (r.stdout + r.stderr), (env, r.stdout, r.stderr)
    # the guard is the first thing the GPU stage runs
    gpu_stage = DOCKERFILE[DOCKERFILE.index("FROM base AS stack-gpu"):]
    assert dockerfile_runs(gpu_stage)[0].removeprefix("RUN ").strip() == guard


def test_the_dockerfile_refuses_an_efa_installer_without_its_checksum(tmp_path):
    efa_run = next(r for r in RUNS if "efa_installer.sh" in r)
    assert efa_run.split("--mount=type=secret,id=ca ")[1].startswith(': "${EFA_INSTALLER_SHA256:?')
    # and lock-env fetch downloads nothing without a checksum
    curl = tmp_path / "curl"
    curl.write_text(f"#!/bin/sh\necho called >> {tmp_path}/curl-called\n")
    curl.chmod(0o755)
    r = subprocess.run(["sh", str(LOCK_ENV), "fetch", "https://example.invalid/x.tar.gz", str(tmp_path / "x"), ""],
                       capture_output=True, text=True, env=_sh_env(tmp_path))
    assert r.returncode != 0 and "no sha256" in r.stderr
    assert not (tmp_path / "curl-called").exists()


# --- defects 2 and 5: CMake for a source-built TE, NCCL EP stated, no build isolation ------------------


def test_te_builds_get_cmake_and_the_locks_nccl_ep_choice():
    te_run = next(r for r in RUNS if "NVTE_FRAMEWORK=pytorch" in r)
    assert "NVTE_WITH_NCCL_EP" in te_run.split("&&")[0]  # exported to both builds
    assert ': "${NVTE_WITH_NCCL_EP:?' in te_run
    assert "command -v cmake" in te_run
    for t in ("b200", "h200", "gb200"):
        assert build_args(load(t))["NVTE_WITH_NCCL_EP"] == "0"


def test_muse_stack_is_installed_without_build_isolation():
    run = next(r for r in RUNS if "--editable /opt/muse-stack" in r)
    assert "--no-build-isolation" in run and "--no-deps" in run
