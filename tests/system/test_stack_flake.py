"""The flake's outputs evaluate: `stackFor`, `imageFor` and containers/nix/stack.nix run against a
stand-in nixpkgs (tests/fixtures/nix/stub-nixpkgs: nixpkgs' lib functions and derivations that
record their arguments), for every lock on every system, as `nix flake check` would evaluate them.
The image a Nix build makes carries the lock's identity, the entrypoint's tools and the lock's
build settings; a lock Nix cannot build (gb200: TE from a source commit) is left out of the
outputs with its reason instead of making the whole flake fail on aarch64."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from image_helpers import nix_instantiate
from muse_stack.stack import build_args, load
from muse_stack.stack.buildargs import image_tag

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "tests" / "fixtures" / "nix" / "stub-nixpkgs"


@pytest.fixture(scope="module")
def nix() -> str:
    return nix_instantiate()


PRELUDE = f"""
let
  flake = import {ROOT}/flake.nix;
  stub = {STUB};
  nixpkgs = {{ lib = import (stub + "/lib.nix"); outPath = stub; rev = "stub"; }};
  out = flake.outputs {{ self = {{ }}; inherit nixpkgs; }};
  pkgsFor = system: import stub {{ inherit system; }};
  lockOf = name: import {ROOT}/containers/nix/lock.nix {{ lockFile = {ROOT}/containers/locks + "/${{name}}.toml"; }};
  wheelsetOf = name: import {ROOT}/containers/nix/wheelset.nix {{ pylockFile = {ROOT}/containers/locks + "/pylock.${{name}}.toml"; }};
  stackOf = system: name: let p = pkgsFor system; in import {ROOT}/containers/nix/stack.nix {{
    pkgs = p; lock = lockOf name; wheelset = wheelsetOf name; cudaPackages = p.cudaPackages_13_0; }};
in
"""


def _eval(nix: str, body: str):
    r = subprocess.run([nix, "--eval", "--strict", "--json", "-E", PRELUDE + body], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    return r


def _ok(nix: str, body: str):
    r = _eval(nix, body)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_every_package_and_dev_shell_evaluates_on_every_system(nix):
    # deepSeq: every derivation's arguments, all the way down (the wheel fetches, the compiled
    # sdists, the venvs, the image layers), as `nix flake check` evaluates each output
    got = _ok(nix, """{
      packages = builtins.mapAttrs (sys: ps: builtins.deepSeq ps (builtins.attrNames ps)) out.packages;
      devShells = builtins.mapAttrs (sys: ss: builtins.deepSeq ss (builtins.attrNames ss)) out.devShells;
      notBuiltByNix = out.lib.notBuiltByNix;
    }""")
    assert got["packages"] == {
        "x86_64-linux": ["image-b200", "image-cpu", "image-h200", "wheelset-b200", "wheelset-cpu", "wheelset-h200"],
        "aarch64-linux": ["wheelset-gb200"],
    }
    assert got["devShells"] == {"x86_64-linux": ["b200", "cpu", "default", "h200"], "aarch64-linux": []}
    # the one image only the Dockerfile builds, and why
    assert list(got["notBuiltByNix"]) == ["gb200"]
    assert "make image gpu=gb200" in got["notBuiltByNix"]["gb200"]
    assert load("gb200").lock.components.transformer_engine.source_commit in got["notBuiltByNix"]["gb200"]


@pytest.mark.parametrize("target", ["b200", "h200", "cpu"])
def test_image_for_carries_the_locks_identity_and_the_entrypoints_tools(nix, target):
    got = _ok(nix, f"""let a = out.packages.x86_64-linux.image-{target}.args; in {{
      inherit (a) name tag;
      contents = map (c: c.name) a.contents;
      inherit (a.config) Entrypoint User Env Labels;
      source = (builtins.head (builtins.filter (c: c.name == "muse-stack-root-{target}") a.contents)).args.script;
    }}""")
    lk = load(target)
    assert f"{got['name']}:{got['tag']}" == image_tag(lk)
    assert got["Labels"]["dev.muse-stack.lock.sha256"] == lk.sha256
    assert got["Labels"]["dev.muse-stack.lock.name"] == target
    assert got["Entrypoint"] == ["/usr/local/bin/muse-stack-entrypoint"] and got["User"] == "1000:1000"
    # the entrypoint's tools (bash, coreutils, grep, awk) and nothing it would need besides
    for tool in ("bash-interactive", "coreutils", "gnugrep", "gawk"):
        assert tool in got["contents"]
    assert "muse-stack-entrypoint" in got["source"]
    # the set's cuDNN and NCCL come before every system folder on the loader's path
    ld = next(e for e in got["Env"] if e.startswith("LD_LIBRARY_PATH=")).removeprefix("LD_LIBRARY_PATH=").split(":")
    if lk.lock.kind == "gpu":
        assert ld[0].endswith("/nvidia/cudnn/lib") and ld[1].endswith("/nvidia/nccl/lib"), ld
    system = [i for i, d in enumerate(ld) if d.startswith(("/usr/lib", "/usr/local/nvidia"))]
    assert system and all(i >= (2 if lk.lock.kind == "gpu" else 0) for i in system)


@pytest.mark.parametrize("target", ["b200", "h200"])
def test_stack_nix_compiles_the_sets_sdists_with_the_locks_settings(nix, target):
    got = _ok(nix, f"""map (d: {{ inherit (d) name; build = d.args.buildPhase; }}) (stackOf "x86_64-linux" "{target}").built""")
    args = build_args(load(target))
    by = {d["name"].split("-sdist-build")[0]: d["build"] for d in got}
    assert set(by) == {"flash-attn", "transformer-engine-torch"}
    te = by["transformer-engine-torch"]
    assert f"export NVTE_CUDA_ARCHS='{args['NVTE_CUDA_ARCHS']}'" in te
    assert f"export NVTE_WITH_NCCL_EP='{args['NVTE_WITH_NCCL_EP']}'" in te and args["NVTE_WITH_NCCL_EP"] == "0"
    assert f"export FLASH_ATTN_CUDA_ARCHS='{args['FLASH_ATTN_CUDA_ARCHS']}'" in by["flash-attn"]


def test_a_source_built_te_stops_a_nix_image_with_the_dockerfile_as_the_way(nix):
    r = _eval(nix, '(stackOf "aarch64-linux" "gb200").env.name')
    assert r.returncode != 0
    assert "Build this image with the Dockerfile (make image gpu=gb200)" in " ".join(r.stderr.split())
    # its wheel set alone evaluates
    assert _ok(nix, '(stackOf "aarch64-linux" "gb200").wheels.name') == "muse-stack-gb200-wheels"


@pytest.mark.parametrize("target", ["b200", "h200"])
def test_the_compilers_cuda_tree_is_made_of_nixpkgs_cuda_packages(nix, target):
    # every package of CUDA_HOME is an attribute of nixpkgs' cudaPackages (the stand-in carries the
    # names of nixpkgs' CUDA 13.0 manifest): a name nixpkgs lacks stops evaluation, never drops out
    got = _ok(nix, f"""let s = stackOf "x86_64-linux" "{target}"; in map (p: p.name) s.cudaHome.args.paths""")
    assert {"cuda_nvcc", "cuda_cudart", "cuda_crt", "libcublas"} <= set(got), got
    r = _eval(nix, f"""let p = pkgsFor "x86_64-linux"; s = import {ROOT}/containers/nix/stack.nix {{
      pkgs = p; lock = lockOf "{target}"; wheelset = wheelsetOf "{target}";
      cudaPackages = removeAttrs p.cudaPackages_13_0 [ "cuda_crt" ]; }}; in map (p: p.name) s.cudaHome.args.paths""")
    assert r.returncode != 0 and "has no cuda_crt" in r.stderr, r.stderr[-2000:]
