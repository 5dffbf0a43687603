"""Build checks: the two packages the GPU image compiles from source compile here, on a CPU
machine, against the lock's own torch, with nvcc from the registry.

- flash-attn 2.7.4.post1: its setup.py asks for -std=c++17, and the b200 lock's torch 2.14.1
  headers need C++20. Unpatched, a kernel fails to compile against those headers (the negative
  control); prepared by containers/flash_attn_prepare.py (the step the Dockerfile runs), one
  forward kernel compiles for sm_90 with the sdist's own flags and holds sm_90 code.
- transformer-engine-torch 2.17.0: one translation unit of TE's PyTorch extension compiles with
  the flags TE's build_tools give it plus the ones torch's BuildExtension adds.

Everything comes from the b200 wheel set or from tests/fixtures/build/cuda-nvcc.txt, hash-checked
(tests/helpers/buildcheck.py); the first run downloads about 2.4 GB, later runs reuse the cache. The
compiles take minutes and up to about 3 GB of memory on one core each; the tests carry the `build`
marker, run in `make test`, and alone with `make build-check` (measured: benchmarks/results/build-check/).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from muse_stack.stack.lock import load

import buildcheck
from buildcheck import ROOT

pytestmark = pytest.mark.build

TARGET = "b200"
PREPARE = ROOT / "containers" / "flash_attn_prepare.py"
# one forward kernel of flash-attn 2's sm80 family, the kernels FA2 runs on sm_90: the causal
# one, whose local-window variants fold into the causal ones, so it compiles about twice as fast
# as its non-causal twin (about 5 against 11 minutes here)
FA_KERNEL = "csrc/flash_attn/src/flash_fwd_hdim32_fp16_causal_sm80.cu"
# the -gencode setup.py adds when FLASH_ATTN_CUDA_ARCHS holds 90
FA_SM90 = "arch=compute_90,code=sm_90"
# one translation unit of TE's PyTorch extension; every one includes the same torch, CUDA,
# cuDNN and NCCL headers through csrc/common.h and csrc/extensions.h
TE_UNIT = "csrc/extensions/misc.cpp"


def _prepare():
    import importlib.util

    spec = importlib.util.spec_from_file_location("flash_attn_prepare", PREPARE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


prepare = _prepare()


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)


def _torch_nvcc_flags(torch_dir: Path) -> list[str]:
    """COMMON_NVCC_FLAGS of the lock's torch.utils.cpp_extension: every .cu file of a
    CUDAExtension is compiled with them."""
    tree = ast.parse((torch_dir / "utils" / "cpp_extension.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMON_NVCC_FLAGS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("torch's cpp_extension.py has no COMMON_NVCC_FLAGS list")


def _torch_includes(torch_dir: Path) -> list[Path]:
    # torch.utils.cpp_extension.include_paths(): include/ and the C++ API's include/
    return [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]


def _python_include() -> str:
    # Python.h of the interpreter running the tests; the image builds with its own (3.12), and
    # no header used here differs between the two
    return sysconfig.get_paths()["include"]


@pytest.fixture(scope="module")
def torch_dir() -> Path:
    return buildcheck.torch_tree(TARGET)


@pytest.fixture(scope="module")
def cuda_home() -> Path:
    return buildcheck.nvcc_toolkit()


@pytest.fixture(scope="module")
def flash_attn(tmp_path_factory, torch_dir):
    """The set's flash-attn sdist: its flags as shipped, then prepared by the image's script."""
    src = buildcheck.sdist(TARGET, "flash-attn", tmp_path_factory.mktemp("flash-attn"))
    shipped = prepare.compile_flags(src)
    res = _run([sys.executable, PREPARE, "patch", src, "--torch", torch_dir])
    assert res.returncode == 0, res.stderr
    return {"dir": src, "shipped": shipped, "prepared": prepare.compile_flags(src), "report": res.stdout}


def _compile_fa_kernel(src: Path, nvcc_flags: list[str], cuda_home: Path, torch_dir: Path, out: Path):
    """nvcc as torch's BuildExtension runs it for one of flash_attn_2_cuda's .cu files."""
    includes = [src / "csrc" / "flash_attn", src / "csrc" / "flash_attn" / "src", src / "csrc" / "cutlass" / "include"]
    includes += _torch_includes(torch_dir) + [cuda_home / "include", _python_include()]
    cmd = [cuda_home / "bin" / "nvcc", "-c", src / FA_KERNEL, "-o", out]
    cmd += [f"-I{d}" for d in includes]
    cmd += ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=flash_attn_2_cuda"]
    cmd += _torch_nvcc_flags(torch_dir) + ["-Xcompiler", "-fPIC"]
    # setup.py's nvcc flags, one nvcc thread (append_nvcc_threads), the sm_90 target
    cmd += nvcc_flags + ["--threads", "1", "-gencode", FA_SM90]
    return _run(cmd)


def _requirements(text: str) -> dict[str, set[str]]:
    """name==version -> its hashes, from a uv pip compile output."""
    out: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if re.match(r"^[A-Za-z0-9][\w.\-\[\],]*==", line):
            current = line.split()[0]
            out[current] = set()
        elif line.startswith("--hash=sha256:") and current:
            out[current].add(line.split(":", 1)[1].rstrip(" \\"))
    return out


@pytest.mark.registry
def test_nvcc_requirements_are_what_their_documented_command_resolves(tmp_path):
    """tests/fixtures/build/cuda-nvcc.txt is what the command in cuda-nvcc.in makes today."""
    from uv import find_uv_bin

    src = buildcheck.NVCC_REQUIREMENTS.with_suffix(".in")
    lines = src.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Regenerate"))
    command = ""
    for line in lines[start + 1 :]:
        command += line.lstrip("# ").rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            break
    argv = shlex.split(command)
    assert argv[:3] == ["uv", "pip", "compile"], argv
    out = tmp_path / "cuda-nvcc.txt"
    argv[argv.index("-o") + 1] = str(out)
    res = _run([find_uv_bin(), *argv[1:]], cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    committed = _requirements(buildcheck.NVCC_REQUIREMENTS.read_text())
    assert "nvidia-cuda-nvcc==13.0.88" in committed and all(committed.values())
    assert _requirements(out.read_text()) == committed


def test_the_locks_torch_states_the_cxx_standard_it_needs(torch_dir):
    std, witnesses = prepare.torch_standard(torch_dir)
    # the __cplusplus guard of torch/all.h, the -std torch's extension builder adds and
    # TorchConfig.cmake's CXX_STANDARD all exist in torch 2.14.1 and agree
    assert len(witnesses) == 3, witnesses
    assert std == "c++20"


def test_registry_nvcc_is_the_locks_cuda(cuda_home):
    res = _run([cuda_home / "bin" / "nvcc", "--version"])
    assert res.returncode == 0, res.stderr
    assert f"release {load(TARGET).lock.cuda.version}," in res.stdout


def test_prepare_rewrites_exactly_the_flags_torch_needs(flash_attn, torch_dir):
    std = prepare.torch_standard(torch_dir)[0]
    shipped, prepared = flash_attn["shipped"], flash_attn["prepared"]
    assert "-std=c++17" in shipped["cxx"] and "-std=c++17" in shipped["nvcc"]
    for target in ("cxx", "nvcc"):
        assert prepared[target] == [f"-std={std}" if f == "-std=c++17" else f for f in shipped[target]]
    assert flash_attn["report"].count("(was -std=c++17)") == 2


def test_unpatched_flash_attn_does_not_compile_against_the_locks_torch(flash_attn, cuda_home, torch_dir, tmp_path):
    """The negative control: the sdist's own -std=c++17 fails in torch's headers."""
    res = _compile_fa_kernel(flash_attn["dir"], flash_attn["shipped"]["nvcc"], cuda_home, torch_dir, tmp_path / "k.o")
    assert res.returncode != 0
    errors = [line for line in (res.stdout + res.stderr).splitlines() if ": error" in line]
    assert errors and all(line.startswith(str(torch_dir / "include")) for line in errors[:5]), errors[:5]


def test_prepared_flash_attn_kernel_compiles_for_sm90(flash_attn, cuda_home, torch_dir, tmp_path):
    assert "9.0" in load(TARGET).lock.components.flash_attn.cuda_archs
    assert f'"{FA_SM90}"' in (flash_attn["dir"] / "setup.py").read_text()
    obj = tmp_path / (Path(FA_KERNEL).stem + ".o")
    res = _compile_fa_kernel(flash_attn["dir"], flash_attn["prepared"]["nvcc"], cuda_home, torch_dir, obj)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    elves = _run([cuda_home / "bin" / "cuobjdump", "--list-elf", obj])
    assert elves.returncode == 0, elves.stderr
    archs = re.findall(r"\.(sm_\d+a?)\.cubin", elves.stdout)
    assert archs and set(archs) == {"sm_90"}, elves.stdout


def _te_build(src: Path, cuda_home: Path) -> dict:
    """TE's own build_tools, asked (in a child interpreter, as setup.py would) for the
    extension's sources, include directories and compile flags."""
    probe = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, '.')\n"
        "from build_tools.pytorch import setup_pytorch_extension\n"
        "from build_tools.utils import get_frameworks\n"
        "import torch\n"
        "ext = setup_pytorch_extension('csrc', Path('csrc').resolve(), Path('common_headers').resolve())\n"
        "print(json.dumps({'frameworks': get_frameworks(), 'sources': ext.sources, 'cxx': ext.extra_compile_args['cxx'],\n"
        "  'include_dirs': ext.include_dirs, 'local_torch': str(Path(torch.__file__).parent)}))\n"
    )
    env = dict(os.environ, CUDA_HOME=str(cuda_home), NVTE_FRAMEWORK="pytorch")  # as the Dockerfile sets it
    res = _run([sys.executable, "-c", probe], cwd=src, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # CppExtension appends the include paths of the torch this interpreter imports; the
    # lock's torch takes their place
    out["include_dirs"] = [d for d in out["include_dirs"] if not d.startswith(out["local_torch"])]
    return out


def test_te_torch_extension_unit_compiles_against_the_locks_torch(tmp_path, cuda_home, torch_dir):
    src = buildcheck.sdist(TARGET, "transformer-engine-torch", tmp_path / "te")
    te = _te_build(src, cuda_home)
    assert te["frameworks"] == ["pytorch"]
    assert TE_UNIT in te["sources"]
    # TE adds no -std of its own for the PyTorch build, so torch's BuildExtension adds the
    # standard torch needs (torch.utils.cpp_extension: append the -std when none is present)
    assert not any(f.startswith("-std=") for f in te["cxx"]), te["cxx"]
    std = prepare.torch_standard(torch_dir)[0]
    includes = te["include_dirs"] + [str(p) for p in buildcheck.library_headers(TARGET)]
    includes += [str(p) for p in _torch_includes(torch_dir)] + [_python_include()]
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    # the host compiler line setuptools builds: the interpreter's CFLAGS and CCSHARED
    base = shlex.split(sysconfig.get_config_var("CFLAGS") or "") + shlex.split(sysconfig.get_config_var("CCSHARED") or "")
    obj = tmp_path / "misc.o"
    cmd = cxx + base + [f"-I{d}" for d in includes] + ["-c", src / TE_UNIT, "-o", obj]
    cmd += te["cxx"] + ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=transformer_engine_torch"]
    cmd += [f"-std={std}"]
    res = _run(cmd)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    assert obj.read_bytes()[:4] == b"\x7fELF"
