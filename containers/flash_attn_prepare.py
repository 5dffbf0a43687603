"""Prepare flash-attn's sdist for the torch it is built against: set the C++ standard of its
CUDA extension to the one that torch's headers require.

The locked flash-attn's setup.py compiles `flash_attn_2_cuda` with `-std=c++17` (in both its
"cxx" and "nvcc" flags), and the locked torch's headers need C++20 (c10/util/intrusive_ptr.h
uses `operator<=>`; torch/all.h stops with "C++20 or later compatible compiler is required"), so
the sdist does not build unpatched (tests/system/test_build_kernels.py shows both). Standard library only: the image build runs this file with the
base's python3 before muse-stack is installed.

Interface (exit 0 on success, 1 with a message on stderr naming the file and the fix, 2 on usage):

    python3 flash_attn_prepare.py std TORCH_DIR
        Print the C++ standard (e.g. `c++20`) that the torch package at TORCH_DIR requires.
        TORCH_DIR is the installed package directory, as printed by
        `python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))'`, or the `torch/`
        folder of an unpacked wheel. The standard is read from torch itself, from every one of
        these that is present (at least one must be, and all must agree):
          include/torch/csrc/api/include/torch/all.h   the `__cplusplus < NNNNNNL` guard
          utils/cpp_extension.py                       the `-std=c++NN` torch's extensions add
          share/cmake/Torch/TorchConfig.cmake          `CXX_STANDARD NN`

    python3 flash_attn_prepare.py patch SDIST_DIR (--std c++NN | --torch TORCH_DIR)
        Rewrite, in SDIST_DIR/setup.py (an unpacked flash-attn sdist), the -std flag of the
        `flash_attn_2_cuda` CUDAExtension built from csrc/flash_attn/ (the CUDA build; the ROCm
        build's flags are left alone) in its "cxx" and "nvcc" compile arguments to the given
        standard (or to the one `std TORCH_DIR` prints). It fails, and leaves setup.py as it was,
        unless each of the two holds exactly one -std flag: a flash-attn whose setup.py is laid
        out differently cannot skip the patch unnoticed. Prints one line per rewritten flag.
        Running it twice is harmless (the second run finds the flags already at the standard).

    python3 flash_attn_prepare.py jobs SDIST_DIR --max N [--meminfo FILE]
        Print how many parallel compile jobs (MAX_JOBS) the build can afford: the memory available
        now (MemAvailable of /proc/meminfo, or FILE) divided by the memory one job takes as
        flash-attn's own setup.py estimates it (its NinjaBuildExtension: `free_memory_gb / 9`, "each
        JOB peak memory cost is ~8-9GB"), read from SDIST_DIR/setup.py, at most N and at least 1.
        A setup.py that states no such estimate fails (the budget cannot fall back unnoticed). Says
        on stderr how the number was reached.

    python3 flash_attn_prepare.py flags SDIST_DIR
        Print, as JSON, the "cxx" and "nvcc" flag lists (the list literal that holds the -std
        flag) of the `flash_attn_2_cuda` extension: what a test compiles a kernel with.

The image build then installs the patched directory (`pip install --no-build-isolation
SDIST_DIR`); the sdist's own hash is checked when it is downloaded, before this runs.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import tempfile
from pathlib import Path

EXTENSION = "flash_attn_2_cuda"
CUDA_SOURCES = "csrc/flash_attn/"
TARGETS = ("cxx", "nvcc")
STD_FLAG = re.compile(r"-std=(c\+\+\w+)")
STANDARD = re.compile(r"c\+\+\d\d")
# __cplusplus values of the ISO standards (C++17: 201703L, C++20: 202002L, C++23: 202302L)
CPLUSPLUS = {201703: "c++17", 202002: "c++20", 202302: "c++23"}


class PrepareError(ValueError):
    pass


# --- the standard torch needs ------------------------------------------------------------------


def torch_standard(torch_dir: str | Path) -> tuple[str, dict[str, str]]:
    """The C++ standard the torch package at torch_dir requires, and where each witness said so."""
    root = Path(torch_dir)
    if not root.is_dir():
        raise PrepareError(f"torch directory {root} does not exist: pass the installed torch package directory")
    found: dict[str, str] = {}

    header = root / "include" / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
    if header.is_file():
        m = re.search(r"__cplusplus\s*<\s*(\d+)L", header.read_text(encoding="utf-8", errors="replace"))
        if m:
            value = int(m.group(1))
            if value not in CPLUSPLUS:
                raise PrepareError(f"{header}: __cplusplus guard {value}L is not a known C++ standard")
            found[str(header)] = CPLUSPLUS[value]

    ext = root / "utils" / "cpp_extension.py"
    if ext.is_file():
        text = ext.read_text(encoding="utf-8", errors="replace")
        stds = set(STD_FLAG.findall(text)) | set(re.findall(r"cpp_flag_prefix\s*\+\s*'(c\+\+\w+)'", text))
        if len(stds) > 1:
            raise PrepareError(f"{ext}: torch's extension builder names several standards {sorted(stds)}")
        if stds:
            found[str(ext)] = stds.pop()

    cmake = root / "share" / "cmake" / "Torch" / "TorchConfig.cmake"
    if cmake.is_file():
        m = re.search(r"CXX_STANDARD\s+(\d+)", cmake.read_text(encoding="utf-8", errors="replace"))
        if m:
            found[str(cmake)] = f"c++{m.group(1)}"

    if not found:
        raise PrepareError(
            f"{root}: found no C++ standard in torch (no __cplusplus guard in torch/all.h, no -std flag in "
            "utils/cpp_extension.py, no CXX_STANDARD in TorchConfig.cmake); pass --std c++NN instead"
        )
    if len(set(found.values())) > 1:
        detail = "; ".join(f"{k}: {v}" for k, v in found.items())
        raise PrepareError(f"{root}: torch's files disagree on the C++ standard ({detail}); pass --std c++NN")
    return next(iter(found.values())), found


# --- flash-attn's setup.py ---------------------------------------------------------------------


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _extension_args(tree: ast.AST, where: str) -> ast.Dict:
    """The extra_compile_args dict of the CUDAExtension named flash_attn_2_cuda."""
    hits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _call_name(node) == "CUDAExtension"):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        name, sources = kw.get("name"), kw.get("sources")
        # the CUDA build's extension, compiled from csrc/flash_attn/ (ROCm's is from csrc/flash_attn_ck/)
        cuda_sources = isinstance(sources, ast.List) and any(
            isinstance(s, ast.Constant) and str(s.value).startswith(CUDA_SOURCES) for s in sources.elts
        )
        if isinstance(name, ast.Constant) and name.value == EXTENSION and cuda_sources:
            hits.append(kw.get("extra_compile_args"))
    if len(hits) != 1:
        raise PrepareError(
            f"{where}: expected one CUDAExtension(name={EXTENSION!r}, sources=[{CUDA_SOURCES}...]), "
            f"found {len(hits)}; "
            "this flash-attn's setup.py is laid out differently: review the patch for this version"
        )
    args = hits[0]
    if not isinstance(args, ast.Dict):
        raise PrepareError(f"{where}: {EXTENSION}'s extra_compile_args is not a dict literal; review the patch")
    return args


def _std_constants(node: ast.AST) -> list[ast.Constant]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and STD_FLAG.fullmatch(n.value)
    ]


def _targets(source: str, where: str) -> dict[str, ast.AST]:
    try:
        tree = ast.parse(source, filename=where)
    except SyntaxError as exc:
        raise PrepareError(f"{where}: not valid Python: {exc}") from None
    args = _extension_args(tree, where)
    out: dict[str, ast.AST] = {}
    for key, value in zip(args.keys, args.values):
        if isinstance(key, ast.Constant) and key.value in TARGETS:
            out[key.value] = value
    missing = [t for t in TARGETS if t not in out]
    if missing:
        raise PrepareError(f"{where}: {EXTENSION}'s extra_compile_args has no {', '.join(missing)} flags")
    return out


def _std_flags(source: str, where: str) -> dict[str, ast.Constant]:
    flags = {}
    for target, value in _targets(source, where).items():
        consts = _std_constants(value)
        if len(consts) != 1:
            raise PrepareError(
                f"{where}: expected exactly one -std flag in {EXTENSION}'s {target!r} compile arguments, "
                f"found {len(consts)}; this flash-attn's setup.py differs: review the patch for this version"
            )
        flags[target] = consts[0]
    return flags


def _setup_py(sdist_dir: str | Path) -> Path:
    root = Path(sdist_dir)
    setup = root / "setup.py"
    if not setup.is_file():
        raise PrepareError(f"{setup} does not exist: pass the directory of an unpacked flash-attn sdist")
    return setup


def compile_flags(sdist_dir: str | Path) -> dict[str, list[str]]:
    """The "cxx" and "nvcc" flag list literals (the ones holding -std) of flash_attn_2_cuda."""
    setup = _setup_py(sdist_dir)
    source = setup.read_text(encoding="utf-8")
    out = {}
    for target, value in _targets(source, str(setup)).items():
        lists = [n for n in ast.walk(value) if isinstance(n, ast.List) and _std_constants(n)]
        if not lists:
            raise PrepareError(f"{setup}: no -std flag in {EXTENSION}'s {target!r} compile arguments")
        innermost = min(lists, key=lambda n: len(n.elts))
        try:
            out[target] = [str(x) for x in ast.literal_eval(innermost)]
        except ValueError:
            raise PrepareError(f"{setup}: {EXTENSION}'s {target!r} flag list is not a literal") from None
    return out


def patch(sdist_dir: str | Path, standard: str) -> list[str]:
    """Rewrite the -std flags of flash_attn_2_cuda to `standard`; return one line per flag."""
    if not STANDARD.fullmatch(standard):
        raise PrepareError(f"--std {standard!r}: give a standard such as c++20")
    setup = _setup_py(sdist_dir)
    source = setup.read_text(encoding="utf-8")
    flags = _std_flags(source, str(setup))
    lines = source.splitlines(keepends=True)
    report = []
    # rewrite from the end of the file so earlier offsets stay valid
    for target, node in sorted(flags.items(), key=lambda kv: (kv[1].lineno, kv[1].col_offset), reverse=True):
        if node.lineno != node.end_lineno:
            raise PrepareError(f"{setup}:{node.lineno}: the -std flag spans lines; review the patch")
        line = lines[node.lineno - 1]
        # ast offsets are in UTF-8 bytes
        raw = line.encode("utf-8")
        literal = raw[node.col_offset : node.end_col_offset].decode("utf-8")
        new_literal = literal.replace(node.value, f"-std={standard}")
        lines[node.lineno - 1] = (raw[: node.col_offset] + new_literal.encode("utf-8") + raw[node.end_col_offset :]).decode(
            "utf-8"
        )
        state = "already" if node.value == f"-std={standard}" else "was " + node.value
        report.append(f"{setup}:{node.lineno}: {target}: -std={standard} ({state})")
    patched = "".join(lines)
    after = _std_flags(patched, str(setup))
    wrong = {t: n.value for t, n in after.items() if n.value != f"-std={standard}"}
    if wrong:
        raise PrepareError(f"{setup}: the rewrite left {wrong}; setup.py is unchanged")
    if patched != source:
        fd, tmp = tempfile.mkstemp(dir=setup.parent, prefix=".setup.py.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(patched)
            os.chmod(tmp, setup.stat().st_mode & 0o7777)
            os.replace(tmp, setup)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return sorted(report)


# --- command line ------------------------------------------------------------------------------


JOB_ESTIMATE = re.compile(r"free_memory_gb\s*/\s*(\d+(?:\.\d+)?)\)")


def gb_per_job(sdist_dir: str | Path) -> float:
    """The memory one compile job takes, in GiB, as flash-attn's setup.py budgets its own jobs."""
    path = _setup_py(sdist_dir)
    found = JOB_ESTIMATE.findall(path.read_text())
    if len(found) != 1:
        raise PrepareError(f"{path}: found {len(found)} memory-per-job estimates (`free_memory_gb / N`), want one; "
                           "read how this flash-attn budgets MAX_JOBS and pass --max accordingly")
    return float(found[0])


def available_gib(meminfo: str | Path = "/proc/meminfo") -> float:
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1024 * 1024)  # kB -> GiB
    raise PrepareError(f"{meminfo} has no MemAvailable line")


def jobs(sdist_dir: str | Path, most: int, meminfo: str | Path = "/proc/meminfo") -> tuple[int, str]:
    """MAX_JOBS for building flash-attn here, and how it was reached."""
    if most < 1:
        raise PrepareError(f"--max {most}: give at least 1 job")
    per, free = gb_per_job(sdist_dir), available_gib(meminfo)
    n = max(1, min(most, int(free // per)))
    return n, (f"flash-attn: {n} compile jobs ({free:.1f} GiB available, {per:g} GiB a job as its setup.py "
               f"estimates, at most {most})")


def main(argv: list[str]) -> int:
    usage = (__doc__ or "").split("Interface", 1)[-1]
    try:
        if len(argv) == 2 and argv[0] == "std":
            print(torch_standard(argv[1])[0])
            return 0
        if len(argv) in (4, 6) and argv[0] == "jobs" and argv[2] == "--max" and (len(argv) == 4 or argv[4] == "--meminfo"):
            if not argv[3].isdigit():
                raise PrepareError(f"--max {argv[3]!r}: give a whole number of jobs (the build's MAX_JOBS)")
            n, how = jobs(argv[1], int(argv[3]), *(argv[5:6]))
            sys.stderr.write(how + "\n")
            print(n)
            return 0
        if len(argv) == 2 and argv[0] == "flags":
            print(json.dumps(compile_flags(argv[1]), indent=2))
            return 0
        if len(argv) == 4 and argv[0] == "patch" and argv[2] in ("--std", "--torch"):
            standard = argv[3] if argv[2] == "--std" else torch_standard(argv[3])[0]
            for line in patch(argv[1], standard):
                print(line)
            return 0
    except PrepareError as exc:
        sys.stderr.write(f"flash_attn_prepare: {exc}\n")
        return 1
    sys.stderr.write(f"flash_attn_prepare: unexpected arguments {argv!r}\nInterface{usage}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
