"""Hash-pinned wheel sets: each lock's pylock.<target>.toml is what uv resolves from the lock, pins
every component at the locked version with the declared overrides, hashes every file, and still
is still served by the package registry as committed (needs PyPI, not the day: a later upload
changes nothing it checks). Whether the lock's loose requirements would resolve differently today is
drift for review, not a verdict on this code: the `registry` tests, run by `make locks-check` and
left out of `make test`."""

from __future__ import annotations

import copy
import tomllib

import pytest

from muse_stack.machine.table import table
from muse_stack.stack import pylock, wheelset
from muse_stack.stack.lock import LoadedLock, load, parse

TARGETS = list(table().locks())  # the machine table's locks
GPU = ["gb200", "b200", "h200"]


def _edited(target: str, edit) -> LoadedLock:
    lk = load(target)
    data = copy.deepcopy(lk.data)
    edit(data)
    return LoadedLock(lock=parse(data), path=lk.path, sha256=lk.sha256, data=data)


@pytest.mark.parametrize("target", TARGETS)
def test_committed_set_matches_its_lock(target):
    res = wheelset.check(load(target))
    assert res.ok, res.problems
    # every file of every package is hash-pinned (pylock.parse refuses one without sha256)
    assert all(p.wheels or p.sdist for p in res.packages.values())


@pytest.mark.parametrize("target", GPU)
def test_recorded_cudnn_is_an_explicit_override_of_torchs_metadata(target):
    lk = load(target)
    (ov,) = [o for o in lk.lock.overrides if o.package == "nvidia-cudnn-cu13"]
    assert ov.version == lk.lock.components.cudnn.version == "9.22.0.52"
    assert "9.24.0.43" in ov.replaces
    pkgs = wheelset.check(lk).packages
    assert pkgs["nvidia-cudnn-cu13"].version == "9.22.0.52"
    assert pkgs["torch"].version == "2.14.1"


def test_only_the_compiled_packages_are_sdists():
    b200 = wheelset.check(load("b200")).packages
    sdist_only = {k for k, p in b200.items() if not p.wheels}
    assert sdist_only == {"flash-attn", "transformer-engine-torch"}
    # DeepEP is installed from its wheel (the registry publishes no sdist of it)
    assert b200["sgl-deep-ep"].wheels and b200["sgl-deep-ep"].version == "0.1.2.post1"
    # gb200 builds TE from a source commit: no TE distribution comes from the registry
    gb = wheelset.check(load("gb200")).packages
    assert not any(k.startswith("transformer-engine") for k in gb)
    assert all("aarch64" in w.filename or "none-any" in w.filename or "py3-none" in w.filename
               for p in gb.values() for w in p.wheels if "manylinux" in w.filename or "linux" in w.filename)


def test_a_changed_pin_makes_the_set_stale():
    lk = _edited("b200", lambda d: d["components"]["nccl"].__setitem__("version", "2.30.5"))
    res = wheelset.check(lk)
    assert not res.ok
    assert any("stale" in p for p in res.problems)
    assert any("nvidia-nccl-cu13 is 2.30.7 in the set, the lock pins 2.30.5" in p for p in res.problems)


def test_a_dropped_override_is_caught():
    lk = _edited("b200", lambda d: d.__setitem__("overrides", []))
    res = wheelset.check(lk)
    assert any("stale" in p for p in res.problems)


def test_a_tampered_hash_is_a_difference(tmp_path):
    lk = load("h200")
    text = wheelset.set_path(lk).read_text()
    torch = wheelset.check(lk).packages["torch"]
    bad = text.replace(torch.wheels[0].sha256, "0" * 64)
    p = tmp_path / "pylock.h200.toml"
    p.write_text(bad)
    committed = wheelset.check(lk, p).packages
    fresh = wheelset.check(lk).packages
    assert wheelset.differences(committed, fresh) == [
        "torch 2.14.1: the registry's files differ from the committed hashes"
    ]


def test_pylock_requirement_lines_and_refusals():
    _, pkgs = pylock.load(wheelset.set_path(load("b200")))
    lines = pylock.requirement_lines(pkgs, only={"torch", "flash_attn"}, sdists={"flash-attn"})
    assert lines[0].startswith("flash-attn==2.7.4.post1 --hash=sha256:")
    assert lines[1].startswith("torch==2.14.1 --hash=sha256:")
    with pytest.raises(pylock.PylockError, match="only an sdist"):
        pylock.requirement_lines(pkgs, only={"flash-attn"})
    with pytest.raises(pylock.PylockError, match="not in the wheel set: nope"):
        pylock.requirement_lines(pkgs, only={"nope"})


def test_pylock_refuses_a_file_without_hash():
    doc = {"lock-version": "1.0", "packages": [{"name": "x", "version": "1", "wheels": [{"url": "https://e/x.whl"}]}]}
    with pytest.raises(pylock.PylockError, match="sha256"):
        pylock.parse(doc)


def test_pylock_cli_prints_requirements(capsys):
    path = wheelset.set_path(load("cpu"))
    assert pylock.main(["requirements", str(path), "--only", "torch"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("torch==2.13.0+cpu --hash=sha256:")
    assert pylock.main(["requirements", str(path), "--bogus", "x"]) == 2


# --- the committed sets as the registry serves them (any day) -------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_each_committed_set_resolves_to_itself_from_its_pins(target):
    """Every package of the set pinned (name==version) with the lock's overrides resolves, for the
    target's Python and platform, to exactly the set, and every committed file is served with its
    committed sha256: what the Dockerfile and the flake install exists and installs together."""
    assert wheelset.verify_pinned(load(target)) == []


def test_the_pinned_check_is_a_command(cli):
    rc, out, err = cli("stack", "resolve", "cpu", "--pinned")
    assert rc == 0, err
    assert "ok cpu: its committed set resolves to itself, every file served as committed" in out


def test_a_hash_the_registry_does_not_serve_is_named(tmp_path):
    lk = load("cpu")
    text = wheelset.set_path(lk).read_text()
    pkgs = wheelset.check(lk).packages
    wheel = pkgs["pyyaml"].wheels[0]
    p = tmp_path / "pylock.cpu.toml"
    p.write_text(text.replace(wheel.sha256, "0" * 64))
    assert wheelset.verify_pinned(lk, p) == [
        f"pyyaml {pkgs['pyyaml'].version}: {wheel.filename} is not served with its committed sha256"
    ]


def test_a_package_missing_from_the_set_is_named(tmp_path):
    """A set that lost a dependency (idna, which requests needs) no longer resolves to itself."""
    lk = load("cpu")
    text = wheelset.set_path(lk).read_text()
    idna = wheelset.check(lk).packages["idna"]
    blocks = text.split("\n[[packages]]\n")
    kept = [b for b in blocks if not b.startswith('name = "idna"\n')]
    assert len(kept) == len(blocks) - 1
    p = tmp_path / "pylock.cpu.toml"
    p.write_text("\n[[packages]]\n".join(kept))
    assert wheelset.verify_pinned(lk, p) == [f"idna {idna.version}: needed by the pinned set but not in it"]


# --- drift: what the lock's loose requirements resolve to today (make locks-check) ---------------


@pytest.mark.registry
@pytest.mark.parametrize("target", TARGETS)
def test_each_lock_resolves_to_its_committed_set(target):
    """A fresh uv resolution for the target's Python and platform (x86_64 for h200/b200/cpu,
    aarch64 for gb200), as of the lock's exclude_newer date, gives exactly the committed set:
    no conflict, every recorded version resolvable, every file's hash unchanged."""
    assert wheelset.resolve_and_compare(load(target)) == []


@pytest.mark.registry
def test_a_recorded_version_that_does_not_resolve_fails_naming_it():
    # TE 2.17.0 publishes no aarch64 core wheel: as a wheel build on gb200 it cannot resolve
    def wheel_te(d):
        te = d["components"]["transformer_engine"]
        te["build"] = "wheel"
    lk = _edited("gb200", wheel_te)
    with pytest.raises(wheelset.ResolveError) as e:
        wheelset.resolve_text(lk)
    assert "transformer-engine-cu13" in e.value.message


@pytest.mark.registry
def test_aarch64_te_wheels_resolve_where_the_registry_has_them():
    # 2.17.1 has an aarch64 CUDA 13 wheel: a gb200 wheel build of it resolves
    def te_2171(d):
        te = d["components"]["transformer_engine"]
        te["build"], te["version"] = "wheel", "2.17.1"
    text = wheelset.resolve_text(_edited("gb200", te_2171))
    pkgs = pylock.parse(tomllib.loads(text))
    assert pkgs["transformer-engine-cu13"].version == "2.17.1"
    assert any("aarch64" in w.filename for w in pkgs["transformer-engine-cu13"].wheels)


@pytest.mark.registry
def test_a_conflict_without_override_fails():
    # without the named override, torch 2.14.1's metadata and the recorded cuDNN conflict
    lk = _edited("b200", lambda d: d.__setitem__("overrides", []))
    with pytest.raises(wheelset.ResolveError) as e:
        wheelset.resolve_text(lk)
    assert "nvidia-cudnn-cu13" in e.value.message


# --- selfcheck ---------------------------------------------------------------------------------------

from muse_stack.stack import selfcheck  # noqa: E402


def test_selfcheck_refuses_cudnn_sublibraries_from_another_folder(monkeypatch, tmp_path):
    """Seen on an H200 machine: the wheel's libcudnn.so.9 shim with /usr/lib's apt cuDNN 9.14
    sub-libraries (found by soname); cudnnGetVersion then reports 9.14 and fused attention fails."""
    mapped = ["/env/nvidia/cudnn/lib/libcudnn.so.9", "/usr/lib/x86_64-linux-gnu/libcudnn_graph.so.9.14.0"]
    monkeypatch.setattr(selfcheck, "_mapped", lambda prefix: [p for p in mapped if p.rsplit("/", 1)[1].startswith(prefix)])
    got, where = selfcheck._loaded_version("cudnn", "libcudnn.so.*", "cudnnGetVersion", selfcheck._cudnn)
    assert got is None
    assert "mapped from 2 folders" in where and "libcudnn_graph.so.9.14.0" in where


def test_selfcheck_version_decoding():
    assert selfcheck._cudnn(92200) == "9.22.0"
    assert selfcheck._nccl(23007) == "2.30.7"


def test_selfcheck_on_this_environment_reports_every_set_package():
    report = selfcheck.run(load("cpu"), image=False)
    names = {row["what"] for row in report["wheel_set"][1:]}
    assert names == {p.name for p in wheelset.check(load("cpu")).packages.values()}
    assert report["components"][0]["what"] == "python"


def test_gpu_sets_carry_wandb_and_a_source_built_te_gets_cmake():
    """W&B runs inside the GPU images (logging.wandb), hash-locked like the rest; gb200's TE source
    build runs CMake, from the set's cmake wheel; muse-stack's build backend is in every set."""
    for t in ("b200", "h200", "gb200", "cpu"):
        lk = load(t)
        pkgs = wheelset.check(lk).packages
        assert "setuptools" in pkgs, t
        if lk.lock.kind != "gpu":
            assert "wandb" not in pkgs
            continue
        assert "wandb" in pkgs, t
        for key, p in pkgs.items():  # wandb and its dependencies too: every file hash-pinned
            files = list(p.wheels) + ([p.sdist] if p.sdist else [])
            assert files and all(len(f.sha256) == 64 for f in files), (t, key)
        te = lk.lock.components.transformer_engine
        assert ("cmake" in pkgs) == (te.build == "source"), t
        assert ("cmake" in wheelset.requirements(lk)) == (te.build == "source")
