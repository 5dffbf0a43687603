"""docs/images.md and the README's Images section say what the evidence says: the replay's limits
are read from its committed self-check and fingerprint, the set sizes and lock hashes from the
locks as they are now, and the pins from the locks."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from muse_stack.stack import load, wheelset

ROOT = Path(__file__).resolve().parents[2]
DOC = " ".join((ROOT / "docs" / "images.md").read_text().split())
README = " ".join((ROOT / "README.md").read_text().split())
REPLAY = ROOT / "benchmarks" / "results" / "replay-b200"


def test_the_replay_is_described_as_it_ran():
    sc = json.loads((REPLAY / "selfcheck.json").read_text())
    fp = json.loads((REPLAY / "fingerprint.json").read_text())
    set_size = len(sc["wheel_set"]) - 1
    outside = len(sc["outside_set"])
    assert f"91 of the set's {set_size} packages" in DOC
    assert f"counted {outside} distributions outside the set" in DOC
    # flash-attn is the one component the self-check failed on
    failed = {c["what"] for c in sc["components"] if not c["ok"]}
    assert failed == {"flash_attn (import)"} and "flash-attn was absent" in DOC
    # the libraries the run mapped twice, and from where
    twice = {k for k, v in fp["cuda_libraries"].items() if isinstance(v, dict) and v.get("multiple_copies_loaded")}
    assert twice == {"cuda_runtime", "nvrtc"}
    assert "cudart and NVRTC were loaded twice" in DOC
    for k in twice:
        folders = {p["path"].rsplit("/", 1)[0] for p in fp["cuda_libraries"][k]["files"].values()}
        assert any(f.startswith("/opt/torch/.venv") for f in folders) and any(f.startswith("/usr/local/cuda") for f in folders)
    assert "/opt/torch/.venv" in DOC and "/usr/local/cuda-13.0" in DOC
    # the first replay's lock is not today's; the isolated replay's is
    assert f"sha256 `{sc['lock_sha256'][:8]}...`" in DOC and sc["lock_sha256"] != load("b200").sha256
    isolated = json.loads((REPLAY.parent / "replay-b200-isolated" / "selfcheck.json").read_text())
    assert f"`lock_sha256`, `{isolated['lock_sha256'][:8]}...`" in DOC
    # the lock changed since only outside the wheel set: the replayed set's resolution inputs are today's
    kept = tomllib.loads((REPLAY.parent / "replay-b200-isolated" / "pylock.b200.toml").read_text())
    assert kept["tool"]["muse-stack"]["inputs-sha256"] == wheelset.inputs_sha256(load("b200"))
    assert "its wheel set's inputs are today's" in DOC
    assert isolated["outside_set"] == [] and len(isolated["wheel_set"]) - 1 == len(wheelset.check(load("b200")).packages)
    assert {c["what"] for c in isolated["components"] + isolated["wheel_set"] if not c["ok"]} == {"flash_attn (import)", "flash-attn"}
    assert "ok for every component but flash-attn" in DOC


def test_the_set_sizes_and_the_cpu_lock_hash_are_todays():
    sizes = {t: len(wheelset.check(load(t)).packages) for t in ("b200", "h200", "gb200", "cpu")}
    assert f"b200 and h200 now hold {sizes['b200']} packages, gb200 {sizes['gb200']}" in DOC
    assert sizes["b200"] == sizes["h200"]
    assert (f"b200 and h200 {sizes['b200']} packages, gb200 {sizes['gb200']}, cpu {sizes['cpu']}") in DOC
    # the image-test transcript names one cpu lock in its tag and identity line, the one the text names
    m = re.search(r"identity ok: lock cpu sha256 ([0-9a-f]{64}) in labels", DOC)
    assert m and f"built muse-stack:cpu-0.1.0-{m.group(1)[:12]}" in DOC
    assert f"with the cpu lock of that day (sha256 `{m.group(1)[:8]}...`" in DOC
    if m.group(1) != load("cpu").sha256:  # a transcript of an earlier lock says the tag is new now
        assert "`make image-test gpu=cpu` now builds a new tag" in DOC


def test_the_docs_name_the_pins_the_locks_hold_and_that_no_gpu_image_was_built():
    lk = load("b200").lock
    d, e = lk.base.digest.removeprefix("sha256:"), lk.components.efa.installer_sha256
    assert f"`sha256:{d[:8]}...{d[-7:]}`" in DOC and f"`{e[:8]}...{e[-7:]}`" in DOC
    assert "No GPU image has been built yet" in DOC
    assert "make pins gpu=TARGET" in DOC and "make pins gpu=TARGET" in README
    assert "Not built anywhere yet:** the GPU images" in README
    assert "stack check --strict" in README
    # the deviation count the docs quote is what `stack check` prints for the cpu lock
    assert "the cpu lock's four deviations cover all 11 differing pins, so \"4 of them\"" in DOC
    assert len(load("cpu").lock.deviations) == 4


def test_the_deepep_archs_in_the_docs_are_the_locks():
    for t in ("b200", "h200", "gb200"):
        assert load(t).lock.components.deepep.cuda_archs == ["9.0", "10.0", "10.3"]
    assert "carry 9.0, 10.0 and 10.3 there" in DOC
    assert re.search(r"DEEPEP_TORCH_CUDA_ARCH_LIST=9\.0;10\.0;10\.3", DOC)
