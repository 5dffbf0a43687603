"""Stack locks: every lock validates, the targets have the right platform and arch lists, the
b200 lock is the B200 record's stack, and a broken lock names the field and the fix."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest

from muse_stack.cli import main
from muse_stack.machine.table import table
from muse_stack.stack import build_args, cuda_capabilities, load, locks_dir, unresolved
from muse_stack.stack.lock import LockError, Null, parse
from muse_stack.stack.record import compare, problems

ROOT = Path(__file__).resolve().parents[2]
TARGETS = list(table().locks())  # the machine table's locks


def _lock_text(name: str) -> str:
    return (ROOT / "containers" / "locks" / f"{name}.toml").read_text()


def test_the_four_targets_have_locks_and_all_validate():
    assert sorted(p.stem for p in locks_dir().glob("*.toml") if not p.stem.startswith("pylock.")) == sorted(TARGETS)
    for t in TARGETS:
        lk = load(t)
        assert lk.name == t
        assert lk.sha256 == hashlib.sha256(lk.path.read_bytes()).hexdigest()


def test_gb200_is_arm64_sm100_and_builds_te_from_source():
    lk = load("gb200").lock
    assert lk.platform == "linux/arm64"
    c = lk.components
    for comp in (c.transformer_engine, c.flash_attn):  # compiled in the image
        assert comp.cuda_archs == ["10.0"]
    # DeepEP's aarch64 registry wheel is not compiled here: the lock states the machine code it carries
    assert c.deepep.cuda_archs == ["9.0", "10.0", "10.3"]
    assert c.transformer_engine.build == "source" and c.transformer_engine.with_nccl_ep is False
    # the v2.17 release tag's commit, checked against the 2.17.0 wheel's and sdist's files
    assert c.transformer_engine.source_commit == "2e559f062497bef768dfbe9d7e45548fadeca80a"
    args = build_args(load("gb200"))
    assert args["NVTE_CUDA_ARCHS"] == "100"
    assert args["FLASH_ATTN_CUDA_ARCHS"] == "100"
    assert args["DEEPEP_TORCH_CUDA_ARCH_LIST"] == "9.0;10.0;10.3"
    assert args["NVTE_WITH_NCCL_EP"] == "0"
    assert args["PLATFORM"] == "linux/arm64"


def test_b200_reproduces_the_recorded_stack():
    lk = load("b200").lock
    c = lk.components
    assert (lk.platform, lk.cuda.version, lk.python.version) == ("linux/amd64", "13.0", "3.12.3")
    assert c.torch.version == "2.14.1" and c.torch.index_url == "https://pypi.org/simple"  # the cu130 build
    assert c.transformer_engine.version == "2.17.0"
    assert c.nccl.version == "2.30.7"
    assert c.cudnn.version == "9.22.0.52" and c.cudnn.purge_apt_cudnn is True
    assert c.flash_attn.version == "2.7.4.post1"
    assert (c.deepep.package, c.deepep.version) == ("sgl-deep-ep", "0.1.2.post1")
    assert c.megatron_core.version == "0.19.0"
    assert c.efa.installer_version == "1.49.0" and c.efa.aws_ofi_nccl == "1.20.0"
    assert lk.reference.digest == "sha256:2b46ca326003e347c600145bd60935b42af8032ed6f0a75e7fdc7bf5a8700b15"
    # sm90 and sm100 as recorded; flash-attn gets its own variable (it ignores TORCH_CUDA_ARCH_LIST)
    args = build_args(load("b200"))
    assert args["NVTE_CUDA_ARCHS"] == "90;100"
    assert args["FLASH_ATTN_CUDA_ARCHS"] == "90;100"
    assert args["DEEPEP_TORCH_CUDA_ARCH_LIST"] == "9.0;10.0;10.3"
    # as both sources of the installer's checksum run it (the lock's installer_sha256_sources)
    assert args["EFA_INSTALL_FLAGS"] == "--build-ngc --skip-kmod --skip-limit-conf --skip-mpi --no-verify"
    assert args["APT_BASE_PACKAGES"] == "ca-certificates=20261130ubuntu0.24.04.1 python3=3.12.3-0ubuntu2.1 python3-venv=3.12.3-0ubuntu2.1"
    assert args["APT_BUILD_PACKAGES"].split() == [
        "build-essential=12.10ubuntu1", "curl=8.5.0-2ubuntu10.16", "git=1:2.43.0-1ubuntu7.5", "python3-dev=3.12.3-0ubuntu2.1"]
    # what the image compiles (TE, flash-attn); DeepEP's wheel is checked, not built
    assert cuda_capabilities(lk) == ["9.0", "10.0"]


RECORDED = {  # the recorded stack of attune-b200, as the recipe contract gives it
    "transformer_engine": "2.17.0 (PyTorch extension rebuilt against the installed PyTorch for sm90 and sm100)",
    "pytorch": "2.14.1 (CUDA 13.0 build)",
    "cuda": "13.0",
    "nccl": "2.30.7 (CUDA 13.3 build; printed by the measured run)",
    "cudnn": "9.22.0.52 (runs the attention, `--attention-backend fused`)",
    "flash_attn": "2.7.4.post1 (rebuilt against the installed PyTorch for sm90 and sm100)",
    "deepep": "sgl-deep-ep 0.1.2.post1 (installed; the alltoall dispatcher does not use it)",
    "python": "3.12.3",
    "network": "8 GPUs per node, EFA 1.49 (aws-ofi-nccl 1.20), 3.2 Tb/s RDMA per node",
    "megatron_lm": "radixark/Megatron-LM commit 6530834a (branch muse-spark-open; megatron-core 0.19.0), no local changes",
}


def test_every_lock_matches_the_record_or_declares_the_deviation():
    for t in TARGETS:
        checks = compare(load(t).lock, RECORDED)
        assert len(checks) == 11
        assert problems(checks) == [], t
    assert all(x.ok for x in compare(load("b200").lock, RECORDED))
    cpu = compare(load("cpu").lock, RECORDED)
    assert not any(x.ok for x in cpu) and all(x.deviation for x in cpu)


def test_a_changed_pin_without_deviation_is_caught():
    data = tomllib.loads(_lock_text("b200"))
    data["components"]["nccl"]["version"] = "2.28.9"
    out = problems(compare(parse(data), RECORDED))
    assert len(out) == 1 and "components.nccl.version" in out[0] and "2.30.7" in out[0]


def test_catalogue_record_agrees_when_available():
    catalogue = pytest.importorskip("muse_stack.recipes.catalogue")
    stack = catalogue.load_recipe("attune-b200").stack
    assert stack is not None
    checks = compare(load("b200").lock, stack.model_dump())
    assert checks and all(x.ok for x in checks), [x for x in checks if not x.ok]


def test_deviating_locks_say_why():
    for t in ("gb200", "h200", "cpu"):
        devs = load(t).lock.deviations
        assert devs and all(len(d.reason) > 20 for d in devs), t
    assert [d.field for d in load("h200").lock.deviations][-1] == "components.*.cuda_archs"


def test_cpu_lock_has_no_cuda_components_and_says_why():
    lk = load("cpu").lock
    assert lk.kind == "cpu" and isinstance(lk.cuda, Null)
    for comp in ("transformer_engine", "cudnn", "nccl", "flash_attn", "deepep", "megatron_core", "efa"):
        v = getattr(lk.components, comp)
        assert isinstance(v, Null) and len(v.reason) > 10
    assert lk.components.torch.version == "2.13.0+cpu"
    assert lk.components.torch.index_url == "https://download.pytorch.org/whl/cpu"
    assert (lk.base.source, lk.base.suite, lk.python.version) == ("debootstrap", "bookworm", "3.11.2")
    assert isinstance(lk.base.digest, Null)


# the tag's index digest and the EFA 1.49.0 installer's sha256, as public sources give them
CUDA_INDEX_DIGEST = "sha256:1e8ac7a54c184a1af8ef2167f28fa98281892a835c981ebcddb1fad04bdd452d"
EFA_149_SHA256 = "cf2e9281a2328a243c76f911a490faed43ca0fecfe4733c25e34b2e92a32c309"
GPU = ["gb200", "b200", "h200"]


def test_gpu_locks_pin_the_base_index_digest_and_the_efa_checksum_with_their_sources():
    for t in GPU:
        lk = load(t).lock
        assert (lk.base.image, lk.base.tag) == ("docker.io/nvidia/cuda", "13.0.0-devel-ubuntu24.04"), t
        assert lk.base.digest == CUDA_INDEX_DIGEST and lk.base.ref == f"docker.io/nvidia/cuda@{CUDA_INDEX_DIGEST}"
        assert lk.components.efa.installer_sha256 == EFA_149_SHA256
        # each value cites its sources, and at least two of them name the value's own digits (the
        # sources agree on it); a pin edited without its sources fails here
        for value, sources in ((lk.base.digest, lk.base.digest_sources),
                               (lk.components.efa.installer_sha256, lk.components.efa.installer_sha256_sources)):
            short = value.removeprefix("sha256:")[:8]
            assert sum(short in src for src in sources) >= 2, (t, value, sources)
        assert unresolved(lk) == [], t
        assert build_args(load(t))["BASE_REF"].endswith("@" + CUDA_INDEX_DIGEST)
    assert isinstance(load("cpu").lock.base.digest, Null)  # made locally by debootstrap
    # a source build without its commit is unresolved
    data = tomllib.loads(_lock_text("gb200"))
    data["components"]["transformer_engine"]["source_commit"] = {"null": "not yet looked up"}
    assert "components.transformer_engine.source_commit" in [f for f, _ in unresolved(parse(data))]


def test_a_pin_must_name_its_source():
    e = _broken(lambda d: d["base"].pop("digest_sources"))
    assert e.field == "base.digest_sources" and "make pins" in e.fix
    e = _broken(lambda d: d["components"]["efa"].pop("installer_sha256_sources"))
    assert e.field == "components.efa.installer_sha256_sources"


def unpinned_copy(tmp_path: Path, name: str = "b200") -> Path:
    """A copy of a GPU lock (and its wheel set) with the digest and the EFA checksum left null."""
    text = _lock_text(name)
    text = re.sub(r'^digest = "sha256:[0-9a-f]+"\n', 'digest = { null = "not resolved in this copy" }\n', text, flags=re.M)
    text = re.sub(r'^installer_sha256 = "[0-9a-f]+"\n', 'installer_sha256 = { null = "not resolved in this copy" }\n',
                  text, flags=re.M)
    text = re.sub(r'^(digest|installer_sha256)_sources = \[\n(?:  .*\n)*\]\n', "", text, flags=re.M)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    (tmp_path / f"pylock.{name}.toml").write_text((ROOT / "containers" / "locks" / f"pylock.{name}.toml").read_text())
    return path


def test_an_unpinned_lock_fails_strict_and_says_what_a_networked_builder_runs(tmp_path, capsys):
    path = unpinned_copy(tmp_path)
    assert [f for f, _ in unresolved(load(path).lock)] == ["base.digest", "components.efa.installer_sha256"]
    assert main(["stack", "check", str(path)]) == 0  # valid, with two pins pending
    assert main(["stack", "check", "--strict", str(path)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "base.digest, components.efa.installer_sha256" in err
    for cmd in ("make pins gpu=b200", "skopeo inspect --raw docker://IMAGE:TAG | sha256sum", "crane digest IMAGE:TAG",
                "curl -fsSL URL | sha256sum"):
        assert cmd in err, cmd


# --- broken locks: the error names the field and the fix ------------------------------------


def _broken(mutate) -> LockError:
    data = tomllib.loads(_lock_text("b200"))
    mutate(data)
    with pytest.raises(LockError) as ei:
        parse(data)
    return ei.value


def test_missing_digest_asks_for_explicit_null():
    e = _broken(lambda d: d["base"].pop("digest"))
    assert e.field == "base.digest"
    assert "null" in e.fix and "base.digest" in e.fix


def test_malformed_digest():
    e = _broken(lambda d: d["base"].__setitem__("digest", "sha256:abc"))
    assert e.field == "base.digest" and "64" in e.rule


def test_bad_cuda_arch():
    e = _broken(lambda d: d["components"]["flash_attn"].__setitem__("cuda_archs", ["sm_90"]))
    assert e.field == "components.flash_attn.cuda_archs"
    assert "sm_90" in e.message


def test_apt_cudnn_must_be_purged():
    e = _broken(lambda d: d["components"]["cudnn"].__setitem__("purge_apt_cudnn", False))
    assert e.field == "components.cudnn.purge_apt_cudnn"
    assert "loaded together" in e.message


def test_efa_needs_container_flags():
    e = _broken(lambda d: d["components"]["efa"].__setitem__("install_flags", ["--skip-kmod"]))
    assert e.field == "components.efa.install_flags"
    assert "--no-verify" in e.message and "--skip-limit-conf" in e.message

    # the container mode and MPI left out, as both checksum sources install it
    e = _broken(lambda d: d["components"]["efa"].__setitem__("install_flags", ["--skip-kmod", "--skip-limit-conf", "--no-verify"]))
    assert e.field == "components.efa.install_flags"
    assert "--build-ngc" in e.message and "--skip-mpi" in e.message


def test_apt_packages_are_pinned_and_python3_is_the_locks_python():
    e = _broken(lambda d: d.pop("apt"))
    assert e.field == "apt"
    e = _broken(lambda d: d["apt"]["base"].__setitem__("python3", "3.12"))
    assert e.field.startswith("apt.base") and "3.12" in e.message + str(e.value or "")
    e = _broken(lambda d: d["apt"]["base"].__setitem__("python3", "3.12.7-1ubuntu1"))
    assert e.field == "apt.base.python3" and "3.12.3" in e.message
    e = _broken(lambda d: d["apt"].__setitem__("build", {}))
    assert e.field == "apt.build"


def test_sm100_needs_cuda_12_8():
    e = _broken(lambda d: d["cuda"].__setitem__("version", "12.4"))
    assert e.field.startswith("components.") and e.field.endswith(".cuda_archs")
    assert "12.8" in e.rule


def test_cuda_component_on_a_cpu_lock():
    data = tomllib.loads(_lock_text("cpu"))
    data["components"]["nccl"] = {"package": "nvidia-nccl-cu13", "version": "2.30.7"}
    with pytest.raises(LockError) as ei:
        parse(data)
    assert ei.value.field == "components.nccl" and "null" in ei.value.fix


def test_unknown_key_is_named():
    e = _broken(lambda d: d["components"]["torch"].__setitem__("verison", "1"))
    assert e.field == "components.torch.verison" and "remove" in e.fix


def test_name_must_match_file(tmp_path):
    p = tmp_path / "b300.toml"
    p.write_text(_lock_text("b200"))
    with pytest.raises(LockError) as ei:
        load(p)
    assert ei.value.field == "name" and "b300" in ei.value.fix


def test_missing_lock_is_an_input_error(tmp_path):
    with pytest.raises(LockError) as ei:
        load("h100")
    assert ei.value.exit_code == 3 and "gb200" in ei.value.fix


# --- CLI -------------------------------------------------------------------------------------


def test_cli_build_args_lines_and_json(capsys):
    assert main(["stack", "build-args", "h200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kv = dict(line.split("=", 1) for line in lines)
    assert kv == build_args(load("h200"))
    assert kv["NVTE_CUDA_ARCHS"] == "90" and kv["LOCK_NAME"] == "h200"
    assert main(["stack", "build-args", "--json", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["system"] == "x86_64-linux" and out["cuda_capabilities"] == []
    assert re.fullmatch(r"muse-stack:cpu-[0-9.]+-[0-9a-f]{12}", out["tag"])
    assert out["build_args"]["LOCK_SHA256"] == load("cpu").sha256


def test_cli_check_and_show(capsys, tmp_path):
    for t in TARGETS:
        assert main(["stack", "check", t]) == 0
    for t in TARGETS:  # every pin resolved
        assert main(["stack", "check", "--strict", t]) == 0, t
    assert main(["stack", "show", "gb200"]) == 0
    assert "linux/arm64" in capsys.readouterr().out
    bad = tmp_path / "cpu.toml"
    bad.write_text(_lock_text("cpu").replace('platform = "linux/amd64"', 'platform = "linux/riscv64"'))
    assert main(["stack", "check", str(bad)]) == 2
    assert "platform" in capsys.readouterr().err


def test_cli_check_image_identity(tmp_path, capsys):
    lk = load("cpu")
    info = tmp_path / "image.json"
    info.write_text(json.dumps({"lock_name": "cpu", "lock_sha256": lk.sha256}))
    inspect = tmp_path / "inspect.json"
    labels = {"dev.muse-stack.lock.name": "cpu", "dev.muse-stack.lock.sha256": lk.sha256}
    inspect.write_text(json.dumps([{"Labels": labels}]))
    assert main(["stack", "check", "cpu", "--image-info", str(info), "--inspect", str(inspect)]) == 0
    labels["dev.muse-stack.lock.sha256"] = "0" * 64
    inspect.write_text(json.dumps([{"Config": {"Labels": labels}}]))  # docker's layout
    assert main(["stack", "check", "cpu", "--inspect", str(inspect)]) == 1
    assert "dev.muse-stack.lock.sha256" in capsys.readouterr().err


def test_check_and_show_agree_on_deviations(capsys):
    assert load("b200").lock.reference is not None and load("b200").lock.deviations  # the case of the report
    for t in TARGETS:
        lock = load(t).lock
        assert main(["stack", "show", t, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)["lock"].get("deviations", [])
        assert main(["stack", "check", t]) == 0
        out = " ".join(capsys.readouterr().out.split())  # as words: the line wraps at the terminal's width
        if lock.reference is None:
            continue
        assert len(shown) == len(lock.deviations)
        assert f"{len(shown)} declared deviation(s)" in out, out
        for dev in shown:
            assert dev["field"] in out


# --- make pins: read the pins on a networked builder (skopeo/crane/docker and a download stubbed) ---


def test_pins_reads_the_index_digest_from_the_registrys_raw_manifest(tmp_path, monkeypatch):
    from muse_stack.stack import pins

    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {"digest": "sha256:" + "a" * 64, "platform": {"os": "linux", "architecture": "amd64"}},
        {"digest": "sha256:" + "b" * 64, "platform": {"os": "linux", "architecture": "arm64"}}]}
    raw = json.dumps(index).encode()
    (tmp_path / "raw").write_bytes(raw)
    skopeo = tmp_path / "skopeo"
    skopeo.write_text(f'#!/bin/sh\n[ "$1 $2 $3" = "inspect --raw docker://docker.io/nvidia/cuda:13.0.0-devel-ubuntu24.04" ] '
                      f'|| exit 3\ncat {tmp_path / "raw"}\n')
    skopeo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # the stub first; sh, [ and cat for it
    digest, how, plats = pins.index_digest("docker.io/nvidia/cuda", "13.0.0-devel-ubuntu24.04")
    assert digest == "sha256:" + hashlib.sha256(raw).hexdigest() and how.startswith("skopeo inspect --raw")
    assert plats == ("linux/amd64", "linux/arm64")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert pins.index_digest("docker.io/nvidia/cuda", "x")[0] is None


def test_pins_writes_null_pins_with_their_source_and_never_overwrites_a_different_one(tmp_path, monkeypatch):
    from muse_stack.stack import pins

    path = unpinned_copy(tmp_path)
    monkeypatch.setattr(pins, "index_digest", lambda image, tag: (
        CUDA_INDEX_DIGEST, f"skopeo inspect --raw docker://{image}:{tag} | sha256sum", ("linux/amd64", "linux/arm64")))
    monkeypatch.setattr(pins, "url_sha256", lambda url: (EFA_149_SHA256, f"curl -fsSL {url} | sha256sum"))
    got = pins.run(str(path), write=False)
    assert [(p.field, p.locked, p.ok) for p in got] == [("base.digest", None, False),
                                                       ("components.efa.installer_sha256", None, False)]
    assert unresolved(load(path).lock)  # --write not given: nothing written
    pins.run(str(path), write=True)
    lk = load(path).lock
    assert lk.base.digest == CUDA_INDEX_DIGEST and lk.components.efa.installer_sha256 == EFA_149_SHA256
    assert "skopeo inspect --raw" in lk.base.digest_sources[0] and "(make pins)" in lk.base.digest_sources[0]
    assert unresolved(lk) == [] and main(["stack", "check", "--strict", str(path)]) == 0
    # a source that now says something else is an error, and the lock is left as it is
    before = path.read_text()
    monkeypatch.setattr(pins, "url_sha256", lambda url: ("0" * 64, "curl"))
    with pytest.raises(LockError, match="the source says 0000"):
        pins.run(str(path), write=True)
    assert path.read_text() == before
    # an index without the lock's platform is refused (gb200 pulls linux/arm64 from the same index)
    monkeypatch.setattr(pins, "url_sha256", lambda url: (EFA_149_SHA256, "curl"))
    monkeypatch.setattr(pins, "index_digest", lambda image, tag: (CUDA_INDEX_DIGEST, "skopeo", ("linux/amd64",)))
    with pytest.raises(LockError, match="lists no linux/arm64 manifest"):
        (tmp_path / "g").mkdir()
        pins.run(str(unpinned_copy(tmp_path / "g", "gb200")), write=False)


def test_check_counts_the_deviations_that_cover_a_differing_pin_once_each(capsys):
    assert main(["stack", "check", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # four declared deviations; all four cover some of the 11 pins that differ (not "11 of them")
    assert "0 of 11 pins as recorded; 4 declared deviation(s)" in out and "4 of them cover a pin that differs" in out
    assert main(["stack", "check", "h200"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "11 of 11 pins as recorded; 3 declared deviation(s)" in out and "0 of them cover" in out
