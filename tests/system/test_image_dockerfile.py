"""The Dockerfile consumes every pin of every lock and holds no version of its own; the
container scripts hold none either; the image carries the identity the contract names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from muse_stack.machine.table import table
from muse_stack.stack import KEYS, build_args, load

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
TARGETS = list(table().locks())  # the machine table's locks
# a dotted version (2.17.0, 13.0, 3.12), a digest, or a CUDA-versioned package name (cu13, cu130)
VERSION_LITERAL = re.compile(r"(?<![\w.])\d+\.\d+(?:\.\d+)*(?:\.?post\d+)?(?![\w])|sha256:[0-9a-f]{8,}|\bcu1\d{1,2}\b")
CONTAINER_FILES = [
    "Dockerfile",
    "flake.nix",
    "containers/nix/lock.nix",
    "containers/nix/stack.nix",
    "containers/entrypoint.sh",
    "containers/lock-env.sh",
    "containers/build-image.sh",
    "containers/make-base.sh",
    "containers/image-test.sh",
    "containers/image.mk",
    ".dockerignore",
]


def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def test_every_build_arg_of_every_lock_is_declared_and_used():
    instr = _instructions(DOCKERFILE)
    declared = {m.group(1) for i in instr if (m := re.match(r"ARG (\w+)", i))}
    uses = "\n".join(i for i in instr if not i.startswith("ARG "))
    for t in TARGETS:
        args = build_args(load(t))
        assert tuple(args) == KEYS
        for key in args:
            assert key in declared, f"{key} (from lock {t}) is not an ARG of the Dockerfile"
            assert re.search(r"\$\{?" + key + r"\b", uses), f"ARG {key} is declared but never used"


def test_the_dockerfile_declares_only_lock_args_and_build_context_args():
    declared = {m.group(1) for i in _instructions(DOCKERFILE) if (m := re.match(r"ARG (\w+)", i))}
    not_from_lock = declared - set(KEYS)
    # what is not a pin: where the build runs, what it is built from, and how many compiles at once
    assert not_from_lock == {"PIP_FIND_LINKS", "SOURCE_REVISION", "SOURCE_URL", "BUILT_BY", "CREATED", "MAX_JOBS"}


@pytest.mark.parametrize("rel", CONTAINER_FILES)
def test_no_version_literal_outside_the_locks(rel):
    text = (ROOT / rel).read_text()
    found = VERSION_LITERAL.findall(text)
    assert found == [], f"{rel} holds version literals {found}; versions live in containers/locks only"


def test_no_pinned_value_of_any_lock_repeats_in_the_container_files():
    pins = set()
    for t in TARGETS:
        for k, v in build_args(load(t)).items():
            # a version, digest, checksum or arch list ("100" alone would match uid 1000)
            if k.endswith(("_VERSION", "_SHA256", "_DIGEST", "_ARCHS", "_ARCH_LIST", "_COMMIT")) and (
                "." in v or ";" in v or len(v) >= 40
            ):
                pins.add(v)
    for rel in CONTAINER_FILES:
        text = (ROOT / rel).read_text()
        for v in pins:
            assert v not in text, f"{rel} repeats the pin {v!r}"


def test_version_literal_pattern_catches_what_it_should():
    # the guard itself must be able to fail
    for bad in ["pip install torch==2.14.1", "FROM nvidia/cuda:13.0.0-devel", "flash-attn 2.7.4.post1",
                "nvidia-cudnn-cu13", "@sha256:2b46ca326003e347"]:
        assert VERSION_LITERAL.search(bad), bad
    for ok in ["${TORCH_VERSION}", "MAX_JOBS=8", "x86_64-linux", "chmod 0755", "uid 1000"]:
        assert not VERSION_LITERAL.search(ok), ok


def test_image_identity_labels_user_entrypoint_and_build_features():
    instr = _instructions(DOCKERFILE)
    labels = " ".join(i for i in instr if i.startswith("LABEL"))
    for key in ["version", "revision", "base.name", "base.digest", "created", "source", "title"]:
        assert f"org.opencontainers.image.{key}=" in labels
    assert 'dev.muse-stack.lock.name="${LOCK_NAME}"' in labels
    assert 'dev.muse-stack.lock.sha256="${LOCK_SHA256}"' in labels
    assert 'org.opencontainers.image.base.digest="${BASE_DIGEST}"' in labels
    users = [i.split()[1] for i in instr if i.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert instr[[i.startswith("ENTRYPOINT") for i in instr].index(True)] == \
        'ENTRYPOINT ["/usr/local/bin/muse-stack-entrypoint"]'
    assert "MUSE_STACK_RECIPES=/opt/muse-stack/recipes" in DOCKERFILE
    assert "COPY recipes /opt/muse-stack/recipes" in DOCKERFILE
    assert "--mount=type=cache" in DOCKERFILE and "--mount=type=secret,id=ca" in DOCKERFILE
    assert "/etc/muse-stack/image.json" in DOCKERFILE
    # multi-stage, the stack chosen by the lock's kind
    assert "FROM ${BASE_REF} AS base" in DOCKERFILE and "FROM stack-${STACK_KIND} AS image" in DOCKERFILE
    # the lock copied into the image must hash to the label's sha256
    assert 'echo "${LOCK_SHA256}  /etc/muse-stack/lock.toml" | sha256sum -c -' in DOCKERFILE


def _sh_env(tmp_path: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{tmp_path}:{venv_bin}:{os.environ['PATH']}"}


def test_lock_env_writes_the_image_json_of_the_contract(tmp_path):
    out = tmp_path / "etc" / "image.json"
    subprocess.run(
        ["sh", str(ROOT / "containers/lock-env.sh"), "image-json", str(out), "cpu", "ab" * 32,
         "localhost/muse-stack-base:bookworm-minbase", "", "deadbeef", "0", "linux/amd64", "podman"],
        check=True, env=_sh_env(tmp_path),
    )
    info = json.loads(out.read_text())
    assert set(info) == {"lock_name", "lock_sha256", "base_image", "base_digest", "source_revision",
                         "muse_stack_version", "platform", "built_by"}
    assert info["base_digest"] is None and info["source_revision"] == "deadbeef"
    assert info["lock_sha256"] == "ab" * 32 and info["built_by"] == "podman"


def test_lock_env_pip_check_fails_on_a_different_version(tmp_path):
    ok = subprocess.run(["sh", str(ROOT / "containers/lock-env.sh"), "pip-check", "0.0.0", "pydantic"],
                        capture_output=True, text=True, env=_sh_env(tmp_path))
    assert ok.returncode != 0 and "the lock pins 0.0.0" in ok.stderr


def test_entrypoint_runs_muse_stack_and_links_no_driver_when_absent(tmp_path):
    fake = tmp_path / "muse-stack"
    fake.write_text('#!/bin/sh\necho "muse-stack $*"\necho "LD=${LD_LIBRARY_PATH:-}"\n')
    fake.chmod(0o755)
    r = subprocess.run(["sh", str(ROOT / "containers/entrypoint.sh"), "run", "sft-192"],
                       capture_output=True, text=True, env=_sh_env(tmp_path), check=True)
    assert r.stdout.splitlines()[0] == "muse-stack run sft-192"
    r = subprocess.run(["sh", str(ROOT / "containers/entrypoint.sh"), "muse-stack", "run", "sft-192"],
                       capture_output=True, text=True, env=_sh_env(tmp_path), check=True)
    assert r.stdout.splitlines()[0] == "muse-stack run sft-192"
    r = subprocess.run(["sh", str(ROOT / "containers/entrypoint.sh"), "sh", "-c", "echo other"],
                       capture_output=True, text=True, env=_sh_env(tmp_path), check=True)
    assert r.stdout.strip() == "other"


def test_runs_folder_is_a_volume_owned_by_the_run_user_and_the_image_has_a_short_tag():
    instr = _instructions(DOCKERFILE)
    assert "VOLUME /workspace/runs" in instr
    volume, user = instr.index("VOLUME /workspace/runs"), instr.index("USER muse")
    assert user < volume  # declared after the folder exists with its owner (a VOLUME freezes its content)
    made = next(i for i in instr[:volume] if "mkdir -p /workspace/runs" in i)
    assert "chown -R muse:muse /workspace" in made
    build = (ROOT / "containers/build-image.sh").read_text()
    assert 'short="muse-stack:${arg[LOCK_NAME]}"' in build
    assert build.count('-t "$tag" -t "$short"') == 2  # docker and podman both tag muse-stack:<target>


def _mountinfo(tmp_path: Path, name: str, runs_line: str | None) -> Path:
    lines = ["36 25 0:32 / / rw,relatime - overlay overlay rw,lowerdir=/l"]
    if runs_line:
        lines.append(runs_line)
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("runs_line, expect", [
    (None, "is not a mounted folder: the run's results are lost"),
    ("40 36 8:1 /var/lib/docker/volumes/" + "ab" * 32 + "/_data /workspace/runs rw - ext4 /dev/sda1 rw",
     "is an anonymous volume"),
    ("40 36 8:1 /volumes/myruns/_data /workspace/runs rw - ext4 /dev/sda1 rw", "volume myruns on the host"),
    ("40 36 8:1 /home/u/my\\040runs /workspace/runs rw,relatime - ext4 /dev/nvme0n1p2 rw",
     "mounted from the host's /home/u/my runs (on /dev/nvme0n1p2)"),
])
def test_entrypoint_says_where_a_runs_results_go(tmp_path, runs_line, expect):
    fake = tmp_path / "muse-stack"
    fake.write_text('#!/bin/sh\necho "muse-stack $*"\n')
    fake.chmod(0o755)
    env = {**_sh_env(tmp_path), "MUSE_STACK_MOUNTINFO": str(_mountinfo(tmp_path, "mountinfo", runs_line))}
    r = subprocess.run(["sh", str(ROOT / "containers/entrypoint.sh"), "run", "tiny-cpu"],
                       capture_output=True, text=True, env=env, check=True)
    assert r.stdout.strip() == "muse-stack run tiny-cpu"
    assert expect in r.stderr, r.stderr
    if runs_line is None or "anonymous" in expect:
        assert 'docker run -v "$PWD/runs:/workspace/runs"' in r.stderr
    # other commands, and runs written elsewhere, say nothing about the runs folder
    for args in (["list"], ["run", "tiny-cpu", "--out", "/tmp/x"], ["muse-stack", "run", "x", "--resume=/r"]):
        r = subprocess.run(["sh", str(ROOT / "containers/entrypoint.sh"), *args],
                           capture_output=True, text=True, env=env, check=True)
        assert "/workspace/runs" not in r.stderr, (args, r.stderr)


def test_every_apt_install_is_of_the_locks_pinned_packages():
    """apt-get install takes only the lock's NAME=VERSION pins ([apt.base], [apt.build]), never a bare
    package name whose version the archive chooses on the day of the build."""
    installs = re.findall(r"apt-get install ((?:[^\\\n&|;]|\\\n)*)", DOCKERFILE)
    assert len(installs) == 2
    for args in installs:
        words = [w for w in args.replace("\\\n", " ").split() if not w.startswith("-")]
        assert len(words) == 1 and re.fullmatch(r"\$\{APT_(BASE|BUILD)_PACKAGES\}", words[0]), args
    for target in TARGETS:
        args = build_args(load(target))
        pins = args["APT_BASE_PACKAGES"].split() + args["APT_BUILD_PACKAGES"].split()
        assert pins and all(re.fullmatch(r"[a-z0-9][a-z0-9.+-]+=[0-9:][A-Za-z0-9.+~:-]*", p) for p in pins), pins
        assert ("python3=" + load(target).lock.apt.base["python3"]) in pins
        assert bool(args["APT_BUILD_PACKAGES"]) == (load(target).lock.kind == "gpu")
