"""The flake's pure part (containers/nix/lock.nix and wheelset.nix, no nixpkgs) derives exactly the
build arguments, tag, system and CUDA capabilities of the Python side, for every lock, and turns
every file of each hash-pinned wheel set into a fixed-output fetch with the pylock's url and
sha256; nixpkgs is pinned to one commit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from image_helpers import nix_instantiate
from muse_stack.machine.table import table
from muse_stack.stack import load, pylock, wheelset
from muse_stack.stack.buildargs import summary

ROOT = Path(__file__).resolve().parents[2]
TARGETS = list(table().locks())  # the machine table's locks


@pytest.fixture(scope="module")
def nix() -> str:
    return nix_instantiate()


def _eval(nix: str, expr: str):
    r = subprocess.run([nix, "--eval", "--strict", "--json", "-E", expr], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def nix_locks(nix):
    expr = "{ " + " ".join(
        f'"{t}" = let l = import ./containers/nix/lock.nix {{ lockFile = ./containers/locks/{t}.toml; }}; in '
        "{ inherit (l) buildArgs tag system cudaCapabilities sha256 name kind; };"
        for t in TARGETS
    ) + " }"
    return _eval(nix, expr)


@pytest.mark.parametrize("target", TARGETS)
def test_nix_and_python_derive_identical_build_args(nix_locks, target):
    lk = load(target)
    py = summary(lk)
    nx = nix_locks[target]
    assert nx["buildArgs"] == py["build_args"]
    assert nx["tag"] == py["tag"]
    assert nx["system"] == py["system"]
    assert nx["cudaCapabilities"] == py["cuda_capabilities"]
    assert nx["sha256"] == lk.sha256 and nx["name"] == target and nx["kind"] == lk.lock.kind


def test_gb200_is_an_aarch64_sm100_system_for_nix(nix_locks):
    assert nix_locks["gb200"]["system"] == "aarch64-linux"
    assert nix_locks["gb200"]["cudaCapabilities"] == ["10.0"]
    # what the image compiles (TE, flash-attn); DeepEP is its registry wheel
    assert nix_locks["b200"]["cudaCapabilities"] == ["9.0", "10.0"]


def test_nix_sees_an_edited_lock(nix, tmp_path):
    # the agreement is not vacuous: the Nix side reads the file it is given
    text = (ROOT / "containers/locks/h200.toml").read_text().replace('cuda_archs = ["9.0"]', 'cuda_archs = ["9.0", "8.0"]')
    p = tmp_path / "h200.toml"
    p.write_text(text)
    nx = _eval(nix, f"(import {ROOT}/containers/nix/lock.nix {{ lockFile = {p}; }}).buildArgs")
    py = summary(load(p))["build_args"]
    assert nx == py and nx["NVTE_CUDA_ARCHS"] == "90;80"
    caps = _eval(nix, f"(import {ROOT}/containers/nix/lock.nix {{ lockFile = {p}; }}).cudaCapabilities")
    assert caps == summary(load(p))["cuda_capabilities"] == ["8.0", "9.0"]


def test_flake_parses(nix):
    r = subprocess.run([nix, "--parse", str(ROOT / "flake.nix")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("rel", ["containers/nix/stack.nix", "containers/nix/wheelset.nix"])
def test_nix_files_parse(nix, rel):
    r = subprocess.run([nix, "--parse", str(ROOT / rel)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# --- the hash-pinned wheel sets (containers/nix/wheelset.nix, read by flake.nix) -----------------
# fetchWith is given stand-ins for nixpkgs' fetchurl and requireFile that return their arguments:
# the evaluation shows exactly which fixed-output fetches the flake's derivations are made of.
RECORDERS = (
    '{ fetchurl = a: { fetch = "url"; inherit (a) url sha256 name; }; '
    'requireFile = a: { fetch = "require"; inherit (a) name sha256 message; }; }'
)


def _sets_expr(pylock_path: Path, lock_path: Path) -> str:
    return (
        f"let w = import {ROOT}/containers/nix/wheelset.nix {{ pylockFile = {pylock_path}; }}; "
        f"l = import {ROOT}/containers/nix/lock.nix {{ lockFile = {lock_path}; }}; in "
        f"{{ fetches = map (f: {{ inherit (f) key kind filename; src = f.src; }}) (w.fetchWith {RECORDERS}); "
        "inherit (w) requirements wheelRequirements sdists lockName; "
        "mismatches = w.componentMismatches l.components; }"
    )


def _pylock(target: str) -> Path:
    return ROOT / f"containers/locks/pylock.{target}.toml"


@pytest.fixture(scope="module")
def nix_sets(nix):
    expr = "{ " + " ".join(
        f'"{t}" = {_sets_expr(_pylock(t), ROOT / f"containers/locks/{t}.toml")};' for t in TARGETS
    ) + " }"
    return _eval(nix, expr)


def _expected_files(target: str) -> list[tuple[str, str, str, str]]:
    """(package, kind, url, sha256) of every file the image installs, read by Python's tomllib."""
    doc, pkgs = pylock.load(_pylock(target))
    sdists = set(doc["tool"]["muse-stack"]["sdists"])
    out = [(key, "wheel", a.url, a.sha256) for key, p in pkgs.items() for a in p.wheels]
    out += [(key, "sdist", p.sdist.url, p.sdist.sha256) for key, p in pkgs.items() if key in sdists]
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_every_file_of_the_set_is_a_fixed_output_fetch_with_the_pylock_hash(nix_sets, target):
    expected = _expected_files(target)
    got = []
    for f in nix_sets[target]["fetches"]:
        src = f["src"]
        assert src["name"] == f["filename"]
        if src["fetch"] == "url":
            assert src["url"].rsplit("/", 1)[-1] == f["filename"]
            got.append((f["key"], f["kind"], src["url"], src["sha256"]))
        else:
            # a local file: the build stops with the command that puts exactly that file in the store
            path = next(url for key, _, url, sha in expected if sha == src["sha256"]).removeprefix("file://")
            assert f"nix-store --add-fixed sha256 {path}" in src["message"]
            assert path.rsplit("/", 1)[-1] == f["filename"] and src["sha256"] in src["message"]
            got.append((f["key"], f["kind"], "file://" + path, src["sha256"]))
    assert len(got) == len(expected) == len(set(expected))
    assert sorted(got) == sorted(expected)
    # every package of the set is installed from one of these files
    _, pkgs = pylock.load(_pylock(target))
    assert {k for k, *_ in got} == set(pkgs)


def test_only_the_cpu_set_takes_a_local_file(nix_sets):
    local = {t: [f["filename"] for f in nix_sets[t]["fetches"] if f["src"]["fetch"] == "require"] for t in TARGETS}
    assert local["gb200"] == local["b200"] == local["h200"] == []
    assert [n.split("-")[0] for n in local["cpu"]] == ["torch"]


@pytest.mark.parametrize("target", TARGETS)
def test_nix_requirement_lines_are_the_dockerfiles(nix_sets, target):
    # the lines pip installs from with --require-hashes, as muse_stack/stack/pylock.py writes them
    doc, pkgs = pylock.load(_pylock(target))
    sdists = set(doc["tool"]["muse-stack"]["sdists"])
    nx = nix_sets[target]
    assert nx["requirements"] == "\n".join(pylock.requirement_lines(pkgs, sdists=sdists)) + "\n"
    assert nx["wheelRequirements"] == "\n".join(pylock.requirement_lines(pkgs, exclude=sdists)) + "\n"


@pytest.mark.parametrize("target", TARGETS)
def test_nix_compiles_the_sdists_the_image_compiles(nix_sets, target):
    nx = nix_sets[target]
    assert nx["lockName"] == target
    assert nx["sdists"] == wheelset.sdist_packages(load(target))
    assert nx["mismatches"] == []


def test_nix_sees_an_edited_set(nix, tmp_path):
    # not vacuous: a changed hash changes the fetch, a changed component version is named
    text = _pylock("h200").read_text()
    doc, pkgs = pylock.load(_pylock("h200"))
    old = pkgs["torch"].wheels[0].sha256
    new = "0" * 64
    edited = text.replace(old, new).replace('name = "torch"\nversion = "2.14.1"', 'name = "torch"\nversion = "2.14.0"')
    assert edited.count(new) == 1 and 'version = "2.14.0"' in edited
    p = tmp_path / "pylock.h200.toml"
    p.write_text(edited)
    nx = _eval(nix, _sets_expr(p, ROOT / "containers/locks/h200.toml"))
    torch = [f["src"] for f in nx["fetches"] if f["key"] == "torch"]
    assert [t["sha256"] for t in torch] == [new]
    assert nx["mismatches"] == ["torch 2.14.1 (the set has 2.14.0)"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.split("[tool.muse-stack]")[0], "no [tool.muse-stack] table"),
        (lambda t: t.replace('sdists = ["transformer-engine-torch", "flash-attn"]', 'sdists = ["torch"]'),
         "which the set has no sdist for"),
        (lambda t: t.replace('sdists = ["transformer-engine-torch", "flash-attn"]', 'sdists = ["flash-attn"]'),
         "has only an sdist and is not in [tool.muse-stack].sdists"),
        (lambda t: t.replace('lock-version = "1.0"', 'lock-version = "2.0"'), "lock-version must be 1.0"),
        (lambda t: t.replace("hashes = { sha256 = \"6bc3", "hashes = { sha256 = \"Xbc3", 1), "is not 64 hex digits"),
    ],
)
def test_wheelset_nix_refuses_a_bad_set_naming_the_fault(nix, tmp_path, edit, message):
    text = _pylock("b200").read_text()
    bad = edit(text)
    assert bad != text
    p = tmp_path / "pylock.b200.toml"
    p.write_text(bad)
    r = subprocess.run([nix, "--eval", "--strict", "--json", "-E",
                        f"(import {ROOT}/containers/nix/wheelset.nix {{ pylockFile = {p}; }}).files"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert message in r.stderr and str(p) in r.stderr


def test_upload_times_are_read_and_strings_left_alone(nix, tmp_path):
    # fromTOML has no datetime type: wheelset.nix quotes PEP 751's upload-time values (its only
    # datetime key) and nothing else; a datetime under another key still fails loudly
    body = (
        '[[packages]]\nname = "a"\nversion = "1"\n'
        'sdist = { url = "https://x/a-1.tar.gz", upload-time = 2026-11-18T11:06:55Z, '
        'hashes = { sha256 = "' + "b" * 64 + '" } }\n'
        '[[packages.wheels]]\nurl = "https://x/a-1-py3-none-any.whl#= 2026-01-01T00:00:00Z"\n'
        'upload-time = 2026-11-18T11:06:54.5+01:00\nhashes = { sha256 = "' + "a" * 64 + '" }\n'
        '[tool.muse-stack]\nlock = "t"\nsdists = ["a"]\n'
    )
    p = tmp_path / "pylock.toml"
    p.write_text('lock-version = "1.0"\n' + body)
    nx = _eval(nix, f"(import {ROOT}/containers/nix/wheelset.nix {{ pylockFile = {p}; }}).files")
    assert [(f["kind"], f["url"]) for f in nx] == [
        ("wheel", "https://x/a-1-py3-none-any.whl#= 2026-01-01T00:00:00Z"), ("sdist", "https://x/a-1.tar.gz")]
    p.write_text('lock-version = "1.0"\ncreated = 2026-11-18T11:06:55Z\n' + body)
    r = subprocess.run([nix, "--eval", "--strict", "-E", f"(import {ROOT}/containers/nix/wheelset.nix {{ pylockFile = {p}; }}).files"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "TOML" in r.stderr


def test_nixpkgs_is_pinned_to_a_revision(nix):
    inputs = _eval(nix, f"(import {ROOT}/flake.nix).inputs")
    assert set(inputs) == {"nixpkgs"}
    url = inputs["nixpkgs"]["url"]
    m = re.fullmatch(r"github:NixOS/nixpkgs/([0-9a-f]{40})", url)
    assert m, f"nixpkgs follows {url!r}, not a fixed commit"



def test_flake_lock_locks_the_flakes_nixpkgs_commit_with_its_nar_hash(nix):
    """flake.lock is committed (pure evaluation needs it): one input, nixpkgs, locked at the commit
    flake.nix names, with a sha256 NAR hash of that commit's tree (docs/images.md, Nix, cites where
    it was read); the flake's inputs and the lock's root inputs are the same set."""
    import base64

    inputs = _eval(nix, f"(import {ROOT}/flake.nix).inputs")
    rev = re.fullmatch(r"github:NixOS/nixpkgs/([0-9a-f]{40})", inputs["nixpkgs"]["url"]).group(1)
    doc = json.loads((ROOT / "flake.lock").read_text())
    assert doc["version"] == 7 and doc["root"] == "root"
    assert doc["nodes"]["root"]["inputs"] == {name: name for name in inputs}
    node = doc["nodes"]["nixpkgs"]
    assert node["original"] == {"owner": "NixOS", "repo": "nixpkgs", "rev": rev, "type": "github"}
    locked = node["locked"]
    assert {k: locked[k] for k in ("owner", "repo", "rev", "type")} == {
        "owner": "NixOS", "repo": "nixpkgs", "rev": rev, "type": "github"}
    algo, _, digest = locked["narHash"].partition("-")
    assert algo == "sha256" and len(base64.b64decode(digest, validate=True)) == 32
    assert isinstance(locked["lastModified"], int) and locked["lastModified"] > 0


@pytest.mark.registry
def test_nix_fetches_a_wheel_only_under_its_pylock_hash(nix, tmp_path):
    """Nix's own fetchurl takes the set's hex sha256: the smallest wheel of each GPU set lands in
    the store with exactly the pylock's bytes, and a wrong hash is refused."""
    if not os.access("/nix/store", os.W_OK):
        pytest.skip("the Nix store is not writable here")
    for target in ["gb200", "b200", "h200"]:
        _, pkgs = pylock.load(_pylock(target))
        a = min((a for p in pkgs.values() for a in p.wheels), key=lambda a: a.size or 1 << 62)
        def fetch(sha256: str) -> str:
            return f'builtins.fetchurl {{ url = "{a.url}"; sha256 = "{sha256}"; name = "{a.filename}"; }}'
        path = _eval(nix, fetch(a.sha256))
        assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == a.sha256
        wrong = "f" * 64 if a.sha256 != "f" * 64 else "e" * 64
        r = subprocess.run([nix, "--eval", "--json", "-E", fetch(wrong)], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        assert r.returncode != 0 and "hash mismatch" in r.stderr
