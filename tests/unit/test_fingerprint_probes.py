"""The parsers and helpers behind each fingerprint probe, on crafted inputs."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muse_stack.fingerprint import hashing
from muse_stack.fingerprint.cudalibs import decode_cudnn, decode_nccl, nccl_tuple_text
from muse_stack.fingerprint.environment import collect, redact, secret_values
from muse_stack.fingerprint.gpu import cuda_version_text
from muse_stack.fingerprint.host import parse_containerenv, parse_cpuinfo, parse_os_release
from muse_stack.fingerprint.network import (
    parse_efa_installed_packages,
    parse_fi_info_version,
    plugin_version_from_binary,
)
from muse_stack.fingerprint.procmaps import find_loaded, loaded_shared_objects, parse_maps
from muse_stack.util.credentials import is_secret_key

MAPS = """\
7f1c2a000000-7f1c2a200000 r--p 00000000 08:01 1234  /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2a200000-7f1c2a400000 r-xp 00200000 08:01 1234  /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2b000000-7f1c2b100000 r--p 00000000 08:01 99 /opt/my libs/libcudnn_graph.so.9
7f1c2c000000-7f1c2c100000 r--p 00000000 08:01 77 /site/nvidia/nccl/lib/libnccl.so.2 (deleted)
7f1c2d000000-7f1c2d100000 rw-p 00000000 00:00 0
7ffd1000000-7ffd1021000 rw-p 00000000 00:00 0  [stack]
7f1c2e000000-7f1c2e100000 r--p 00000000 08:01 55 /usr/bin/python3.12
7f1c2f000000-7f1c2f100000 r--p 00000000 08:01 56 /site/torch/_C.cpython-312-x86_64-linux-gnu.so
"""


def test_parse_maps_handles_spaces_deleted_and_anonymous():
    paths = parse_maps(MAPS)
    assert paths == [
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/opt/my libs/libcudnn_graph.so.9",
        "/site/nvidia/nccl/lib/libnccl.so.2",
        "/site/torch/_C.cpython-312-x86_64-linux-gnu.so",
    ]
    assert find_loaded(paths, r"^libcudnn(_[a-z_]+)?\.so") == ["/opt/my libs/libcudnn_graph.so.9"]
    assert find_loaded(paths, r"^libnccl\.so") == ["/site/nvidia/nccl/lib/libnccl.so.2"]


def test_this_process_maps_include_libc():
    assert any("libc.so" in p or "libc-" in p for p in loaded_shared_objects())


@pytest.mark.parametrize(
    "encoded, text",
    [(91002, "9.10.2"), (92200, "9.22.0"), (90100, "9.1.0"), (8902, "8.9.2"), (8600, "8.6.0")],
)
def test_cudnn_decoding(encoded, text):
    assert decode_cudnn(encoded) == text


def test_nccl_and_cuda_decoding():
    assert decode_nccl(23007) == "2.30.7"
    assert decode_nccl(22105) == "2.21.5"
    assert decode_nccl(2708) == "2.7.8"
    assert nccl_tuple_text((2, 28, 9)) == "2.28.9"
    assert nccl_tuple_text((2, 27, 3, "+cuda12.9")) == "2.27.3+cuda12.9"
    assert nccl_tuple_text(22105) == "2.21.5"
    assert cuda_version_text(13000) == "13.0"
    assert cuda_version_text(12040) == "12.4"


def test_os_release_cpuinfo_containerenv():
    rel = parse_os_release('PRETTY_NAME="Ubuntu 24.04.3 LTS"\nID=ubuntu\nVERSION_ID="24.04"\n# c\n')
    assert rel == {"PRETTY_NAME": "Ubuntu 24.04.3 LTS", "ID": "ubuntu", "VERSION_ID": "24.04"}
    cpu = parse_cpuinfo("processor: 0\nmodel name\t: Xeon X\nphysical id\t: 0\n\nprocessor: 1\nmodel name: Xeon X\nphysical id: 1\n")
    assert cpu == {"model": "Xeon X", "sockets": 2}
    env = parse_containerenv('engine="podman-5.0.1"\nname="job"\nrootless=1\nid="abc"\n')
    assert env == {"engine": "podman-5.0.1", "name": "job", "rootless": "1"}


def test_efa_installed_packages_and_fi_info():
    text = "# EFA installer version: 1.49.0\n# Debug packages installed: no\n# Packages installed:\nlibfabric-aws_2.3.1amzn1.0\nrdma-core_58.0-1\n"
    efa = parse_efa_installed_packages(text)
    assert efa["installer_version"] == "1.49.0"
    assert efa["packages"] == ["libfabric-aws_2.3.1amzn1.0", "rdma-core_58.0-1"]
    assert "absent" in parse_efa_installed_packages("rdma-core\n")["installer_version"]
    fi = parse_fi_info_version("fi_info: 2.3.1amzn1.0\nlibfabric: 2.3.1amzn1.0\nlibfabric api: 2.3\n")
    assert fi == {"version": "2.3.1amzn1.0", "api": "2.3"}
    assert "absent" in parse_fi_info_version("garbage")


def test_plugin_version_from_binary(tmp_path):
    lib = tmp_path / "libnccl-net-ofi.so"
    lib.write_bytes(b"\x7fELF" + os.urandom(2000) + b"\x00NET/OFI Initializing %s\x00aws-ofi-nccl 1.20.0\x00" + os.urandom(100))
    assert plugin_version_from_binary(str(lib)) == "1.20.0"
    none = tmp_path / "libnccl-net.so"
    none.write_bytes(b"\x7fELF\x00nothing here\x00")
    assert "absent" in plugin_version_from_binary(str(none))


def test_hashing_is_cached_by_path_size_mtime(tmp_path, monkeypatch):
    f = tmp_path / "libx.so"
    f.write_bytes(b"a" * 1000)
    calls = []
    real = hashing._digest
    monkeypatch.setattr(hashing, "_digest", lambda p: calls.append(p) or real(p))
    hashing.clear_cache()
    first = hashing.file_record(f)
    second = hashing.file_record(f)
    assert first["sha256"] == second["sha256"] and len(calls) == 1
    f.write_bytes(b"b" * 1001)  # size changes: re-hashed
    third = hashing.file_record(f)
    assert third["sha256"] != first["sha256"] and len(calls) == 2
    many = hashing.file_records([str(f), str(f)])
    assert list(many) == [str(f)]


def test_hashing_bounds_large_files(tmp_path, monkeypatch):
    f = tmp_path / "big.so"
    f.write_bytes(b"x" * 4096)
    monkeypatch.setattr(hashing, "MAX_HASH_BYTES", 1024)
    rec = hashing.file_record(f)
    assert rec["size"] == 4096 and "absent" in rec["sha256"]
    missing = hashing.file_record(tmp_path / "gone.so")
    assert "absent" in missing["sha256"]


def test_environment_allow_list_and_secret_names():
    env = {"NCCL_ALGO": "Ring", "HOME": "/root", "HF_TOKEN": "x" * 10, "AWS_SECRET_ACCESS_KEY": "y" * 10,
           "NVTE_DEBUG": "1", "OMP_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "false", "MY_PASSWORD": "p" * 8}
    out = collect(env)
    assert out["variables"] == {"NCCL_ALGO": "Ring", "NVTE_DEBUG": "1", "OMP_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "false"}
    assert out["secrets_set"] == ["AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "MY_PASSWORD"]
    for name in ("WANDB_API_KEY", "GITHUB_TOKEN", "DB_CREDENTIALS"):
        assert is_secret_key(name, env=True), name
    assert not is_secret_key("NCCL_DEBUG", env=True)


def test_redact_scrubs_values_and_url_credentials():
    secrets = secret_values({"HF_TOKEN": "hf_abcdefgh", "SHORT_KEY": "ab"})
    assert secrets == ["hf_abcdefgh"]
    doc = {"a": ["x hf_abcdefgh y", {"url": "https://user:pw@host/x", "n": 3}], "b": None}
    out = redact(doc, secrets)
    assert out == {"a": ["x <redacted> y", {"url": "https://<redacted>@host/x", "n": 3}], "b": None}


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=20),
       st.text(alphabet="abcdefghijklmnop0123456789", min_size=6, max_size=12))
def test_redact_never_leaves_a_secret(obj, secret):
    """Wherever a secret stands whole (the whole value, a token between spaces, after '=' or ':'),
    it is redacted, whatever surrounds it in the document."""
    import json

    planted = {"payload": obj, "leak": f"pre {secret}\tpost", "flag": f"--token={secret}", "url": f"x:{secret}@h",
               "nested": [{"k": secret}]}
    out = redact(planted, [secret])
    del out["payload"]
    assert secret not in json.dumps(out)


def test_redact_matches_whole_values_not_parts_of_words():
    """MY_AUTH_MODE=torch is not a credential: the fingerprint keeps every "torch"; and a secret
    inside a longer word is not rewritten (that would change unrelated fields)."""
    assert secret_values({"MY_AUTH_MODE": "torch", "WANDB_API_KEY": "0123abcd4567"}) == ["0123abcd4567"]
    doc = {"frameworks": {"torch": {"name": "torch", "path": "/usr/lib/python3/torch/lib"}},
           "argv": ["--key", "0123abcd4567"], "word": "x0123abcd4567y"}
    assert redact(doc, secret_values({"MY_AUTH_MODE": "torch", "WANDB_API_KEY": "0123abcd4567"})) == {
        "frameworks": {"torch": {"name": "torch", "path": "/usr/lib/python3/torch/lib"}},
        "argv": ["--key", "<redacted>"], "word": "x0123abcd4567y"}


def test_prefetch_hashes_once_in_the_background(tmp_path, monkeypatch):
    files = []
    for i in range(3):
        f = tmp_path / f"lib{i}.so"
        f.write_bytes(bytes([i]) * 5000)
        files.append(str(f))
    calls = []
    real = hashing._digest
    monkeypatch.setattr(hashing, "_digest", lambda p: calls.append(p) or real(p))
    hashing.clear_cache()
    hashing.prefetch(files + files)
    records = hashing.file_records(files)
    assert sorted(calls) == sorted(os.path.realpath(f) for f in files)
    assert len({r["sha256"] for r in records.values()}) == 3
