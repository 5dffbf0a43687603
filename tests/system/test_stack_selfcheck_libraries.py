"""`stack selfcheck` judges the libraries a process really loads, with real shared objects compiled
here (gcc) standing in for the wheels': cuDNN's shim is made to open its sub-libraries before the
folder check, NCCL must be the wheel set's copy (not merely its version), aws-ofi-nccl's
libnccl-net-ofi.so is not counted as NCCL, TE's extension is load-checked for a source build too,
and DeepEP's and flash-attn's machine code (their .nv_fatbin) must be the lock's architectures."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from muse_stack.fingerprint.fatbin import FATBIN_MAGIC, fatbin_archs, parse_fatbin
from muse_stack.stack import load, selfcheck

ROOT = Path(__file__).resolve().parents[2]

needs_cc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("objcopy") is None,
                              reason="gcc and objcopy compile the stand-in shared objects")


def _cc(src: str, out: Path, soname: str, *extra: str) -> Path:
    c = out.parent / (out.name.replace(".", "_") + ".c")
    c.write_text(textwrap.dedent(src))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(c), f"-Wl,-soname,{soname}", *extra, "-ldl"],
                   check=True, capture_output=True)
    return out


def _fake_cudnn(tmp: Path) -> tuple[Path, Path]:
    """site/nvidia/cudnn/lib: a libcudnn.so.9 shim (RUNPATH $ORIGIN, as the wheel's) that opens
    libcudnn_graph.so.9 by soname when cudnnGraphVersionCheck is called; apt/: a second graph library."""
    lib = tmp / "site" / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    (lib.parent / "__init__.py").write_text("")
    _cc("""
        #include <dlfcn.h>
        #include <stddef.h>
        size_t cudnnGetVersion(void) { return 92200; }
        int cudnnGraphVersionCheck(void) {
          return dlopen("libcudnn_graph.so.9", RTLD_NOW | RTLD_GLOBAL) ? 0 : 1;
        }
    """, lib / "libcudnn.so.9", "libcudnn.so.9", "-Wl,-rpath,$ORIGIN", "-Wl,--enable-new-dtags")
    sub = "int cudnn_graph_marker(void) { return 1; }\n"
    _cc(sub, lib / "libcudnn_graph.so.9", "libcudnn_graph.so.9")
    apt = tmp / "apt"
    apt.mkdir()
    _cc(sub, apt / "libcudnn_graph.so.9", "libcudnn_graph.so.9")
    return lib, apt


def _fake_nccl(tmp: Path) -> tuple[Path, Path, Path]:
    lib = tmp / "site" / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib.parent / "__init__.py").write_text("")
    src = "int ncclGetVersion(int *v) { *v = 23007; return 0; }\n"
    _cc(src, lib / "libnccl.so.2", "libnccl.so.2")
    other = tmp / "usr-lib-triplet"
    other.mkdir()
    _cc(src, other / "libnccl.so.2", "libnccl.so.2")
    ofi = tmp / "ofi-nccl"
    ofi.mkdir()
    _cc("int ncclNetPlugin_v9 = 0;\n", ofi / "libnccl-net-ofi.so", "libnccl-net-ofi.so")
    return lib, other, ofi


def _in_process(tmp: Path, code: str, ld: str = "") -> dict:
    """Run `code` in a fresh interpreter (loaded libraries stay loaded) with the stand-in wheels first."""
    env = {**os.environ, "PYTHONPATH": f"{tmp / 'site'}:{ROOT}", "LD_LIBRARY_PATH": ld}
    prog = "import json, ctypes\nfrom muse_stack.stack import selfcheck as sc\n" + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_cc
def test_cudnn_sub_libraries_are_mapped_before_the_folder_check(tmp_path):
    lib, apt = _fake_cudnn(tmp_path)
    check = """
        got, where = sc._loaded_version("cudnn", "libcudnn.so.*", "cudnnGetVersion", sc._cudnn)
        print(json.dumps({"got": got, "where": where}))
    """
    # the wheel alone: the shim opens its own graph library (RUNPATH $ORIGIN)
    r = _in_process(tmp_path, check)
    assert r["got"] == "9.22.0" and r["where"].startswith(str(lib)), r
    # an apt copy first on the loader's path supplies the sub-library: two folders, a failure
    r = _in_process(tmp_path, check, ld=str(apt))
    assert r["got"] is None and "mapped from 2 folders" in r["where"], r
    assert str(apt) in r["where"]


@needs_cc
def test_nccl_must_be_the_wheel_sets_copy_and_the_ofi_plugin_is_not_nccl(tmp_path):
    lib, other, ofi = _fake_nccl(tmp_path)
    check = """
        got, where = sc._loaded_version("nccl", "libnccl.so.*", "ncclGetVersion", sc._nccl)
        item = sc.library_item("NCCL", "2.30.7", got, where)
        print(json.dumps({"got": got, "where": where, "ok": item.ok}))
    """
    # aws-ofi-nccl's plugin mapped from its own folder beside the set's NCCL: not a second NCCL
    r = _in_process(tmp_path, f"ctypes.CDLL({str(ofi / 'libnccl-net-ofi.so')!r})\n" + textwrap.dedent(check))
    assert r["ok"] and r["got"] == "2.30.7" and r["where"].startswith(str(lib)), r
    # the same version from a system folder is not the set's NCCL
    r = _in_process(tmp_path, f"ctypes.CDLL({str(other / 'libnccl.so.2')!r})\n" + textwrap.dedent(check))
    assert r["got"] == "2.30.7" and not r["ok"] and "not the wheel set's copy" in r["where"], r


def test_family_of_a_library():
    assert selfcheck.in_family("libcudnn_graph.so.9", "libcudnn")
    assert selfcheck.in_family("libnccl.so.2", "libnccl")
    assert not selfcheck.in_family("libnccl-net-ofi.so", "libnccl")
    assert not selfcheck.in_family("libnccl-net.so", "libnccl")


def test_te_extension_is_load_checked_for_a_source_build_too(monkeypatch):
    calls = []
    monkeypatch.setattr(selfcheck, "_te_torch_extension", lambda: calls.append(1) or (None, "ImportError: no ext"))
    items = selfcheck.components(load("gb200"), {})  # TE built from source
    te = [i for i in items if i.what.startswith("TE PyTorch extension")]
    assert calls and len(te) == 1 and "source build" in te[0].what and not te[0].ok


# --- DeepEP's and flash-attn's machine code -----------------------------------------------------------


def fatbin(entries: list[tuple[int, int]], payload: int = 24) -> bytes:
    """A .nv_fatbin container holding (kind, arch) entries (kind 2: cubin, 1: PTX)."""
    body = b""
    for kind, arch in entries:
        head = struct.pack("<HHIQ", kind, 0x0101, 64, payload)
        head += struct.pack("<IIHHI", payload, 0, 8, 1, arch).ljust(48, b"\0")
        body += head + b"\xab" * payload
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_fatbin_entries_are_read_with_their_kind_and_architecture():
    a = parse_fatbin(fatbin([(2, 90), (2, 100), (2, 103), (1, 120)]))
    assert a.sass == ("9.0", "10.0", "10.3") and a.ptx == ("12.0",) and a.entries == 4
    # two containers one after another, padding between them
    two = fatbin([(2, 80)]) + b"\0" * 8 + fatbin([(2, 120)])
    assert parse_fatbin(two).sass == ("8.0", "12.0") and parse_fatbin(two).containers == 2
    with pytest.raises(ValueError):
        parse_fatbin(fatbin([(2, 90)])[:-8])  # cut short


def _extension_with_fatbin(d: Path, name: str, blob: bytes) -> Path:
    so = d / name
    _cc("int marker(void) { return 0; }\n", so, name)
    (d / "fatbin.bin").write_bytes(blob)
    subprocess.run(["objcopy", "--add-section", f".nv_fatbin={d / 'fatbin.bin'}", str(so)], check=True,
                   capture_output=True)
    return so


@needs_cc
def test_deepep_machine_code_is_checked_against_the_lock(tmp_path, monkeypatch):
    pkg = tmp_path / "deep_ep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    so = _extension_with_fatbin(pkg, "_C.cpython-312-x86_64-linux-gnu.so", fatbin([(2, 90), (2, 100), (2, 103)]))
    assert fatbin_archs(so).sass == ("9.0", "10.0", "10.3")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    f = selfcheck._extension_file(("deep_ep._C",), "deep_ep")
    assert f == str(so)
    for target in ("b200", "h200", "gb200"):  # the same registry wheel for all three
        want = load(target).lock.components.deepep.cuda_archs
        item = selfcheck.device_code_item("DeepEP", want, f)
        assert item.ok and item.got == "9.0;10.0;10.3", (target, item)
    # an annotation that is not what the wheel carries fails
    bad = selfcheck.device_code_item("DeepEP", ["9.0"], f)
    assert not bad.ok and bad.got == "9.0;10.0;10.3"
    # a file without device code carries none
    plain = tmp_path / "plain.so"
    _cc("int marker(void) { return 0; }\n", plain, "plain.so")
    assert selfcheck.device_code_item("x", ["9.0"], str(plain)).got == "none"


@needs_cc
def test_the_fingerprint_records_the_loaded_extensions_machine_code(tmp_path):
    from muse_stack.fingerprint import cudalibs

    pkg = tmp_path / "site-packages" / "deep_ep"
    pkg.mkdir(parents=True)
    so = _extension_with_fatbin(pkg, "_C.cpython-312-x86_64-linux-gnu.so", fatbin([(2, 90), (2, 100), (2, 103)]))
    other = tmp_path / "libc.so.6"
    other.write_bytes(b"")
    rec = cudalibs.device_code([str(so), str(other)])
    assert list(rec) == [str(so)]
    assert rec[str(so)]["sass"] == ["9.0", "10.0", "10.3"]
    assert "absent" in json.dumps(cudalibs.device_code([str(other)]))


def _python_extension(d: Path, module: str, blob: bytes) -> Path:
    """A real Python extension module `module` (importable, with a PyInit) in folder d whose
    .nv_fatbin is `blob`: what an import of DeepEP or flash-attn maps into the process."""
    import sysconfig

    leaf = module.rsplit(".", 1)[-1]
    so = d / (leaf + sysconfig.get_config_var("EXT_SUFFIX"))
    src = (f'#include <Python.h>\nstatic struct PyModuleDef m = {{PyModuleDef_HEAD_INIT, "{module}", NULL, -1, NULL}};\n'
           f"PyMODINIT_FUNC PyInit_{leaf}(void) {{ return PyModule_Create(&m); }}\n")
    _cc(src, so, so.name, f"-I{sysconfig.get_paths()['include']}")
    (d / "fatbin.bin").write_bytes(blob)
    subprocess.run(["objcopy", "--add-section", f".nv_fatbin={d / 'fatbin.bin'}", str(so)], check=True,
                   capture_output=True)
    return so


def _cubins(archs: list[str]) -> bytes:
    return fatbin([(2, int(a.replace(".", ""))) for a in archs])


@needs_cc
@pytest.mark.parametrize("lacking", [None, "flash-attn", "DeepEP"])
def test_the_selfcheck_fails_an_image_whose_extension_lacks_a_locked_arch(tmp_path, monkeypatch, lacking):
    """The self-check itself (not only its item builder) reads the machine code of the DeepEP and
    flash-attn extensions an import loads: built here as real extension modules whose .nv_fatbin
    carries the lock's archs, or lacks the last of them. Removing either check from
    `selfcheck.components` fails this test."""
    lk = load("b200")
    c = lk.lock.components
    fa_archs, ep_archs = list(c.flash_attn.cuda_archs), list(c.deepep.cuda_archs)
    assert len(fa_archs) > 1 and len(ep_archs) > 1
    if lacking == "flash-attn":
        fa_archs = fa_archs[:-1]
    if lacking == "DeepEP":
        ep_archs = ep_archs[:-1]
    site = tmp_path / "site"
    (site / "flash_attn").mkdir(parents=True)
    (site / "deep_ep").mkdir()
    # as the real wheels: flash_attn imports its top-level flash_attn_2_cuda; deep_ep its _C
    fa_so = _python_extension(site, "flash_attn_2_cuda", _cubins(fa_archs))
    (site / "flash_attn" / "__init__.py").write_text(f'__version__ = "{c.flash_attn.version}"\nimport flash_attn_2_cuda\n')
    ep_so = _python_extension(site / "deep_ep", "deep_ep._C", _cubins(ep_archs))
    (site / "deep_ep" / "__init__.py").write_text("from deep_ep import _C\n")
    monkeypatch.syspath_prepend(str(site))
    for name in ("flash_attn", "flash_attn_2_cuda", "deep_ep", "deep_ep._C"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(selfcheck, "_installed", lambda: {})

    report = selfcheck.run(lk, image=True)
    code = {i["what"].split(" machine code")[0]: i for i in report["components"] if "machine code" in i["what"]}
    assert set(code) == {"flash-attn", "DeepEP"}, report["components"]
    assert code["flash-attn"]["note"].startswith(str(fa_so)) and code["DeepEP"]["note"].startswith(str(ep_so))
    assert code["flash-attn"]["got"] == ";".join(fa_archs) and code["DeepEP"]["got"] == ";".join(ep_archs)
    for what, item in code.items():
        assert item["ok"] == (what != lacking), item
    failing = [p for p in report["problems"] if "machine code" in p]
    assert len(failing) == (lacking is not None) and not report["ok"]
    if lacking:
        assert failing[0].startswith(lacking)
