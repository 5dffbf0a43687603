"""containers/flash_attn_prepare.py: the image's step that sets flash-attn's C++ standard to the one
torch needs. Fast checks on small setup.py files laid out like flash-attn's; the real sdist and
torch are compiled in test_build_kernels.py (`make build-check`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "containers" / "flash_attn_prepare.py"
_spec = importlib.util.spec_from_file_location("flash_attn_prepare", SCRIPT)
prep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prep)

# the shape of flash-attn 2.7.4.post1's setup.py: a CUDA extension from csrc/flash_attn/ with a
# literal -std in "cxx" and one inside append_nvcc_threads([...] + cc_flag), and a ROCm extension
# of the same name whose flags are built in variables
SETUP = '''\
if not SKIP_CUDA_BUILD and not IS_ROCM:
    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]
    ext_modules.append(
        CUDAExtension(
            name="flash_attn_2_cuda",
            sources=[
                "csrc/flash_attn/flash_api.cpp",
                "csrc/flash_attn/src/flash_fwd_hdim32_fp16_sm80.cu",
            ],
            extra_compile_args={{
                "cxx": {cxx},
                "nvcc": append_nvcc_threads(
                    {nvcc}
                    + cc_flag
                ),
            }},
        )
    )
elif not SKIP_CUDA_BUILD and IS_ROCM:
    cc_flag += ["-O3","-std=c++17"]
    extra_compile_args = {{"cxx": ["-O3", "-std=c++17"], "nvcc": cc_flag}}
    ext_modules.append(CUDAExtension(name="flash_attn_2_cuda", sources=["csrc/flash_attn_ck/mha_fwd.cu"],
                                     extra_compile_args=extra_compile_args))
'''
CXX = ["-O3", "-std=c++17"]
NVCC = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "--expt-relaxed-constexpr", "--use_fast_math"]


def _sdist(tmp_path: Path, cxx=CXX, nvcc=NVCC, text: str | None = None) -> Path:
    d = tmp_path / "flash_attn-2.7.4.post1"
    d.mkdir(exist_ok=True)
    (d / "setup.py").write_text(text if text is not None else SETUP.format(cxx=repr(cxx), nvcc=repr(nvcc)))
    return d


def _torch(tmp_path: Path, guard="202002L", ext_flag="c++20", cmake="20") -> Path:
    t = tmp_path / "torch"
    h = t / "include" / "torch" / "csrc" / "api" / "include" / "torch"
    h.mkdir(parents=True)
    if guard:
        (h / "all.h").write_text(f"#if !defined(_MSC_VER) && __cplusplus < {guard}\n#error C++ too old\n#endif\n")
    (t / "utils").mkdir()
    if ext_flag:
        (t / "utils" / "cpp_extension.py").write_text(
            f"cpp_flag = cpp_flag_prefix + '{ext_flag}'\ncommon_cflags += ['-std={ext_flag}', '-fPIC']\n"
        )
    if cmake:
        c = t / "share" / "cmake" / "Torch"
        c.mkdir(parents=True)
        (c / "TorchConfig.cmake").write_text(f"set_target_properties(torch PROPERTIES CXX_STANDARD {cmake})\n")
    return t


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True)


def test_patch_rewrites_only_the_cuda_extensions_std_flags(tmp_path):
    d = _sdist(tmp_path)
    before = (d / "setup.py").read_text()
    report = prep.patch(d, "c++20")
    after = (d / "setup.py").read_text()
    assert len(report) == 2 and all("(was -std=c++17)" in r for r in report)
    assert prep.compile_flags(d) == {"cxx": ["-O3", "-std=c++20"], "nvcc": [f.replace("17", "20") for f in NVCC]}
    # the two literals change and nothing else: the ROCm branch keeps its flags
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(changed) == 2 and after.count("-std=c++17") == 2
    assert prep.patch(d, "c++20") == [r.replace("(was -std=c++17)", "(already)") for r in report]
    assert (d / "setup.py").read_text() == after


@settings(max_examples=40, deadline=None)
@given(
    cxx=st.lists(st.sampled_from(["-O3", "-g", "-DX=1", "-fPIC"]), max_size=3),
    nvcc=st.lists(st.sampled_from(["-O3", "--use_fast_math", "-lineinfo", "--expt-extended-lambda"]), max_size=4),
    at=st.integers(0, 4),
    std=st.sampled_from(["c++20", "c++23"]),
)
def test_patch_keeps_every_other_flag_in_place(tmp_path_factory, cxx, nvcc, at, std):
    cxx_in = cxx[: at % (len(cxx) + 1)] + ["-std=c++17"] + cxx[at % (len(cxx) + 1) :]
    nvcc_in = nvcc[: at % (len(nvcc) + 1)] + ["-std=c++17"] + nvcc[at % (len(nvcc) + 1) :]
    d = _sdist(tmp_path_factory.mktemp("sd"), cxx_in, nvcc_in)
    prep.patch(d, std)
    swap = lambda fl: [f"-std={std}" if f == "-std=c++17" else f for f in fl]  # noqa: E731
    assert prep.compile_flags(d) == {"cxx": swap(cxx_in), "nvcc": swap(nvcc_in)}


@pytest.mark.parametrize(
    "cxx, nvcc, says",
    [
        (["-O3"], NVCC, "exactly one -std flag in flash_attn_2_cuda's 'cxx'"),
        (CXX, ["-O3", "--use_fast_math"], "exactly one -std flag in flash_attn_2_cuda's 'nvcc'"),
        (CXX, ["-std=c++17", "-O3", "-std=c++17"], "found 2"),
    ],
)
def test_patch_refuses_a_setup_py_without_the_expected_flags(tmp_path, cxx, nvcc, says):
    d = _sdist(tmp_path, cxx, nvcc)
    before = (d / "setup.py").read_text()
    res = _cli("patch", d, "--std", "c++20")
    assert res.returncode == 1 and says in res.stderr and "review the patch" in res.stderr
    assert (d / "setup.py").read_text() == before


def test_patch_refuses_a_setup_py_of_another_layout(tmp_path):
    d = _sdist(tmp_path, text="setup(name='flash_attn', ext_modules=[])\n")
    res = _cli("patch", d, "--std", "c++20")
    assert res.returncode == 1 and "expected one CUDAExtension" in res.stderr
    assert _cli("patch", tmp_path / "missing", "--std", "c++20").stderr.count("unpacked flash-attn sdist") == 1
    res = _cli("patch", d, "--std", "20")
    assert res.returncode == 1 and "--std '20'" in res.stderr
    assert _cli("patch", d).returncode == 2


def test_the_standard_is_read_from_torch(tmp_path):
    t = _torch(tmp_path)
    std, witnesses = prep.torch_standard(t)
    assert std == "c++20" and len(witnesses) == 3
    res = _cli("std", t)
    assert res.returncode == 0 and res.stdout == "c++20\n"
    d = _sdist(tmp_path)
    res = _cli("patch", d, "--torch", t)
    assert res.returncode == 0, res.stderr
    assert prep.compile_flags(d)["nvcc"][1] == "-std=c++20"


def test_one_witness_is_enough_and_disagreement_is_refused(tmp_path):
    assert prep.torch_standard(_torch(tmp_path / "a", ext_flag=None, cmake=None))[0] == "c++20"
    assert prep.torch_standard(_torch(tmp_path / "b", guard=None, cmake=None))[0] == "c++20"
    with pytest.raises(prep.PrepareError, match="disagree"):
        prep.torch_standard(_torch(tmp_path / "c", cmake="17"))
    with pytest.raises(prep.PrepareError, match="pass --std"):
        prep.torch_standard(_torch(tmp_path / "d", guard=None, ext_flag=None, cmake=None))
    res = _cli("std", tmp_path / "nowhere")
    assert res.returncode == 1 and "installed torch package directory" in res.stderr


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            out[name.strip()] = version.split()[0].rstrip("\\").strip()
    return out


def test_build_check_nvcc_matches_the_wheel_sets_cuda():
    """The registry nvcc the build checks use is the CUDA of the b200/h200 sets' torch."""
    pins = _pins(ROOT / "tests" / "fixtures" / "build" / "cuda-nvcc.txt")
    text = (ROOT / "tests" / "fixtures" / "build" / "cuda-nvcc.txt").read_text()
    assert all("--hash=sha256:" in block for block in text.split("==")[1:])
    for target in ("b200", "h200"):
        doc = tomllib.loads((ROOT / "containers" / "locks" / f"pylock.{target}.toml").read_text())
        sets = {p["name"]: p["version"] for p in doc["packages"]}
        for name in ("cuda-toolkit", "nvidia-cuda-runtime"):
            assert pins[name] == sets[name], (target, name)
    assert pins["nvidia-cuda-nvcc"].startswith("13.0.")


# --- the compile jobs, at flash-attn's own estimate of a job's memory ------------------------------------------------

# flash-attn 2.7.4.post1's NinjaBuildExtension, as its setup.py budgets MAX_JOBS when none is given
JOB_BUDGET = '''
class NinjaBuildExtension(BuildExtension):
    def __init__(self, *args, **kwargs) -> None:
        if not os.environ.get("MAX_JOBS"):
            import psutil
            max_num_jobs_cores = max(1, os.cpu_count() // 2)
            free_memory_gb = psutil.virtual_memory().available / (1024 ** 3)  # free memory in GB
            max_num_jobs_memory = int(free_memory_gb / 9)  # each JOB peak memory cost is ~8-9GB when threads = 4
'''


def _meminfo(tmp_path: Path, gib: float) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       999999999 kB\nMemAvailable:   {int(gib * 1024 * 1024)} kB\n")
    return p


@pytest.mark.parametrize(("gib", "most", "want"), [(128, 16, 14), (128, 8, 8), (40, 16, 4), (8, 16, 1), (17.9, 4, 1)])
def test_jobs_are_the_memory_over_flash_attns_own_estimate(tmp_path, gib, most, want):
    d = _sdist(tmp_path, text=SETUP.format(cxx=repr(CXX), nvcc=repr(NVCC)) + JOB_BUDGET)
    assert prep.gb_per_job(d) == 9
    n, how = prep.jobs(d, most, _meminfo(tmp_path, gib))
    assert n == want and "9 GiB a job as its setup.py estimates" in how
    r = _cli("jobs", str(d), "--max", str(most), "--meminfo", str(_meminfo(tmp_path, gib)))
    assert r.returncode == 0 and r.stdout.strip() == str(want), r.stderr


def test_jobs_refuse_a_setup_py_that_states_no_estimate(tmp_path):
    d = _sdist(tmp_path)  # no NinjaBuildExtension budget
    r = _cli("jobs", str(d), "--max", "8", "--meminfo", str(_meminfo(tmp_path, 64)))
    assert r.returncode == 1 and "memory-per-job estimates" in r.stderr and str(d / "setup.py") in r.stderr
    assert _cli("jobs", str(d), "--max", "eight").returncode != 0


def test_the_image_and_the_nix_build_give_flash_attn_its_own_job_budget():
    dockerfile = (ROOT / "Dockerfile").read_text()
    run = next(r for r in dockerfile.split("\nRUN ") if "fetch-sdist \"${FLASH_ATTN_PACKAGE}\"" in r)
    assert 'fa_jobs=$(python3 /usr/local/lib/muse-stack/flash_attn_prepare.py jobs /tmp/fa/src --max "${MAX_JOBS}")' in run
    assert 'MAX_JOBS="${fa_jobs}"' in run and 'MAX_JOBS="${MAX_JOBS}"' not in run
    stack = (ROOT / "containers" / "nix" / "stack.nix").read_text()
    assert 'flash_attn_prepare.py} jobs . --max "$NIX_BUILD_CORES")' in stack
