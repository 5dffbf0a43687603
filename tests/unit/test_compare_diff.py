"""Fingerprint diffs: classification, exit codes, corrupt input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muse_stack.cli import main
from muse_stack.compare.classify import CLASSES, INFORMATIONAL, NUMERICS, PERFORMANCE, classify
from muse_stack.compare.diff import diff_documents

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/fingerprints"
B200 = json.loads((FIXTURES / "crafted-b200-attune.json").read_text())
CPU = json.loads((FIXTURES / "cpu-debian12-torch2.13.json").read_text())


def variant(**edits) -> dict:
    doc = copy.deepcopy(B200)
    for dotted, value in edits.items():
        node = doc
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return doc


def classes(report) -> dict[str, str]:
    return {d.path: d.cls for d in report.differences}


def test_identical_documents_exit_0_even_with_other_capture_time_and_pid():
    other = variant(capture={"captured_at": "2027-01-01T00:00:00+00:00", "seconds": 9.9, "section_seconds": {"x": 1}})
    other["process"]["pid"] = 99
    report = diff_documents(B200, other)
    assert report.identical and report.exit_code == 0 and report.verdict == "identical"


def test_transformer_engine_upgrade_is_numerics():
    te = copy.deepcopy(B200["frameworks"]["transformer_engine"])
    te["version"] = "2.18.0"
    te["core_library"]["sha256"] = "e" * 64
    report = diff_documents(B200, variant(frameworks__transformer_engine=te))
    assert classes(report) == {
        "frameworks.transformer_engine.version": NUMERICS,
        "frameworks.transformer_engine.core_library.sha256": NUMERICS,
    }
    assert report.exit_code == 2


def test_same_version_rebuilt_is_numerics():
    doc = copy.deepcopy(B200)
    libs = doc["frameworks"]["transformer_engine"]["compiled_libraries"]
    libs["transformer_engine/libtransformer_engine.so"]["sha256"] = "0" * 64
    report = diff_documents(B200, doc)
    assert classes(report) == {
        "frameworks.transformer_engine.compiled_libraries.transformer_engine/libtransformer_engine.so.sha256": NUMERICS
    }


def test_nccl_upgrade_is_performance():
    doc = copy.deepcopy(B200)
    doc["cuda_libraries"]["nccl"]["version"] = "2.31.0"
    doc["cuda_libraries"]["nccl"]["torch_reports"] = "2.31.0"
    doc["cuda_libraries"]["nccl"]["files"]["libnccl.so.2"]["sha256"] = "d" * 64
    doc["python"]["distributions"]["nvidia-nccl-cu13"] = "2.31.0"
    report = diff_documents(B200, doc)
    assert set(classes(report).values()) == {PERFORMANCE}
    assert "python.distributions.nvidia-nccl-cu13" in classes(report)
    assert report.exit_code == 1 and report.verdict == "performance-affecting differences only"


def test_hostname_is_informational():
    doc = copy.deepcopy(B200)
    doc["host"]["hostname"] = "p6-b200-node-077"
    doc["process"]["hostname"] = "p6-b200-node-077"
    report = diff_documents(B200, doc)
    assert set(classes(report).values()) == {INFORMATIONAL}
    assert report.exit_code == 0 and report.verdict == "informational differences only"


@pytest.mark.parametrize(
    "path, expected",
    [
        ("cuda_libraries.cudnn.version", NUMERICS),
        ("cuda_libraries.cublas.files.libcublasLt.so.13.sha256", NUMERICS),
        ("cuda_libraries.cublas.files.libcublasLt.so.13.path", INFORMATIONAL),
        ("cuda_libraries.cuda_runtime.version", NUMERICS),
        ("cuda_libraries.driver.version", PERFORMANCE),
        ("frameworks.torch.version", NUMERICS),
        ("frameworks.torch.location", INFORMATIONAL),
        ("frameworks.torch.settings.cudnn_deterministic", NUMERICS),
        ("frameworks.megatron_core.git.commit", NUMERICS),
        ("frameworks.flash_attn.version", NUMERICS),
        ("frameworks.deepep.version", PERFORMANCE),
        ("environment.variables.NVTE_FUSED_ATTN", NUMERICS),
        ("environment.variables.CUBLAS_WORKSPACE_CONFIG", NUMERICS),
        ("environment.variables.NCCL_ALGO", PERFORMANCE),
        ("environment.variables.FI_EFA_USE_DEVICE_RDMA", PERFORMANCE),
        ("environment.variables.MUSE_STACK_IMAGE_DIGEST", INFORMATIONAL),
        ("gpu.devices.3.compute_capability", NUMERICS),
        ("gpu.devices.3.uuid", INFORMATIONAL),
        ("gpu.count", PERFORMANCE),
        ("gpu.names", PERFORMANCE),
        ("gpu.driver_version", PERFORMANCE),
        ("gpu", NUMERICS),
        ("network.efa.installer_version", PERFORMANCE),
        ("network.aws_ofi_nccl.version", PERFORMANCE),
        ("host.cpu.model", PERFORMANCE),
        ("host.hostname", INFORMATIONAL),
        ("process.rank", INFORMATIONAL),
        ("identity.image.lock_sha256", INFORMATIONAL),
        ("run_inputs.recipe_sha256", NUMERICS),
        ("python.distributions.transformer-engine-cu13", NUMERICS),
        ("python.distributions.rich", INFORMATIONAL),
        ("python.version", PERFORMANCE),
    ],
)
def test_classification_table(path, expected):
    assert classify(path) == expected


@given(st.lists(st.text(min_size=0, max_size=12), min_size=1, max_size=6))
def test_classification_is_total(parts):
    assert classify(".".join(parts)) in CLASSES


json_leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
json_docs = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=4),
                         max_leaves=25)


@settings(max_examples=150)
@given(st.dictionaries(st.text(max_size=6), json_docs, max_size=5))
def test_a_document_diffed_with_itself_is_empty(doc):
    report = diff_documents(doc, copy.deepcopy(doc))
    assert report.differences == [] and report.exit_code == 0


@settings(max_examples=150)
@given(st.dictionaries(st.text(max_size=6), json_docs, max_size=4), st.dictionaries(st.text(max_size=6), json_docs, max_size=4))
def test_every_difference_is_classified_and_symmetric(a, b):
    ab, ba = diff_documents(a, b), diff_documents(b, a)
    assert all(d.cls in CLASSES for d in ab.differences)
    assert sorted(d.path for d in ab.differences) == sorted(d.path for d in ba.differences)
    assert ab.exit_code == ba.exit_code
    assert (ab.exit_code == 0) == all(d.cls == INFORMATIONAL for d in ab.differences)


def test_cpu_against_gpu_is_numerics():
    report = diff_documents(CPU, B200)
    c = classes(report)
    assert c["gpu"] == NUMERICS and c["cuda_libraries"] == NUMERICS
    assert report.exit_code == 2


# --- the command line -------------------------------------------------------------------------


def write(tmp_path: Path, name: str, doc) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return p


def test_cli_diff_exit_codes_and_json(tmp_path, capsys):
    a = write(tmp_path, "a.json", B200)
    assert main(["diff", str(a), str(a)]) == 0
    doc = copy.deepcopy(B200)
    doc["host"]["hostname"] = "elsewhere"
    b = write(tmp_path, "b.json", doc)
    assert main(["diff", str(a), str(b)]) == 0  # informational only: two runs on one stack
    perf = copy.deepcopy(doc)
    perf["cuda_libraries"]["nccl"]["version"] = "2.31.0"
    assert main(["diff", str(a), str(write(tmp_path, "p.json", perf))]) == 1
    doc["frameworks"]["transformer_engine"]["version"] = "2.18.0"
    run = tmp_path / "run-b"
    run.mkdir()
    write(run, "fingerprint.json", doc)
    capsys.readouterr()
    assert main(["diff", str(a), str(run), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 2 and out["counts"] == {"numerics": 1, "performance": 0, "informational": 1}
    paths = {d["path"]: d for d in out["differences"]}
    assert paths["frameworks.transformer_engine.version"]["a"] == "2.17.0"
    assert paths["frameworks.transformer_engine.version"]["b"] == "2.18.0"
    assert paths["host.hostname"]["class"] == "informational"
    assert main(["diff", str(a), str(run)]) == 2
    text = capsys.readouterr().out
    assert "transformer_engine.version" in text and "numerics" in text and "exit 2" in text


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"schema_version": 1, "kind": "muse-stack-fi', "not valid JSON"),
        ('{"kind": "muse-stack-fingerprint"}', "no schema_version"),
        ('{"schema_version": "1"}', "must be an integer"),
        ("[1, 2, 3]", "not a fingerprint object"),
        ('{"schema_version": 99}', "schema 99"),
    ],
)
def test_cli_diff_corrupt_input_exits_3_naming_the_file(tmp_path, capsys, content, needle):
    good = write(tmp_path, "good.json", B200)
    bad = write(tmp_path, "broken-fingerprint.json", content)
    assert main(["diff", str(good), str(bad)]) == 3
    err = capsys.readouterr().err
    assert "broken-fingerprint.json" in err and needle in err and "fix:" in err


def test_cli_diff_missing_file_and_empty_run_dir(tmp_path, capsys):
    good = write(tmp_path, "good.json", B200)
    assert main(["diff", str(tmp_path / "nope.json"), str(good)]) == 3
    assert "nope.json" in capsys.readouterr().err
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert main(["diff", str(good), str(empty)]) == 3
    assert "no fingerprint.json" in capsys.readouterr().err


def test_real_h200_capture_against_crafted_b200():
    h200 = json.loads((FIXTURES / "h200-x2-torch2.11.json").read_text())
    assert h200["gpu"]["names"] == ["NVIDIA H200"] and h200["gpu"]["compute_capabilities"] == ["9.0"]
    assert h200["cuda_libraries"]["cudnn"]["version"] == "9.19.0"
    report = diff_documents(h200, B200)
    c = classes(report)
    assert c["gpu.compute_capabilities"] == NUMERICS
    assert c["gpu.devices.0.compute_capability"] == NUMERICS
    assert c["gpu.count"] == PERFORMANCE and c["gpu.driver_version"] == PERFORMANCE
    assert c["cuda_libraries.cudnn.version"] == NUMERICS
    assert c["cuda_libraries.nccl.version"] == PERFORMANCE
    assert c["host.hostname"] == INFORMATIONAL
    assert report.exit_code == 2


def _run_dir(root: Path, name: str, **overrides: str) -> Path:
    """A run directory as `muse-stack run` leaves it, for the diff: fingerprint and resolved recipe."""
    import yaml

    from muse_stack.recipes.catalogue import load_recipe

    run = root / name
    run.mkdir()
    (run / "fingerprint.json").write_text(json.dumps(B200))
    recipe = load_recipe("attune-b200", [f"{k}={v}" for k, v in overrides.items()])
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    return run


def test_run_directories_diff_names_the_recipe_fields_that_differ(tmp_path, capsys):
    from muse_stack.compare.diff import diff_inputs

    a = _run_dir(tmp_path, "a")
    b = _run_dir(tmp_path, "b", **{"layout.ep": "4", "recompute.granularity": "selective",
                                   "engine_options.compile_elementwise": "true", "hardware.price_per_gpu_hour": "3.5"})
    report = diff_inputs(a, b)
    assert classes(report) == {
        "recipe.layout.ep": NUMERICS,
        "recipe.recompute.granularity": PERFORMANCE,
        "recipe.engine_options.compile_elementwise": NUMERICS,
        "recipe.hardware.price_per_gpu_hour": INFORMATIONAL,
    }
    assert report.exit_code == 2
    assert main(["diff", str(a), str(b), "--json"]) == 2
    paths = {d["path"] for d in json.loads(capsys.readouterr().out)["differences"]}
    assert "recipe.layout.ep" in paths


def test_same_recipe_and_stack_is_identical_and_files_carry_no_recipe(tmp_path):
    from muse_stack.compare.diff import diff_inputs

    a, b = _run_dir(tmp_path, "a"), _run_dir(tmp_path, "b")
    assert diff_inputs(a, b).identical
    other = _run_dir(tmp_path, "c", **{"layout.ep": "4"})
    # a fingerprint file against a run directory: only the fingerprints are compared
    assert diff_inputs(a / "fingerprint.json", other).identical


def test_recipe_env_is_classed_like_the_environment():
    assert classify("recipe.env.NVTE_FUSED_ATTN") == NUMERICS
    assert classify("recipe.env.NCCL_ALGO") == PERFORMANCE
    assert classify("recipe.provenance.summary") == INFORMATIONAL
    assert classify("recipe.model.overrides.num_hidden_layers") == NUMERICS


@pytest.mark.parametrize("name", ["PYTHONPATH", "PYTHONHOME", "LD_PRELOAD", "LD_LIBRARY_PATH", "CUDA_HOME"])
def test_code_path_variables_are_numerics(name):
    # they decide which modules and libraries run, so a changed value can change the numbers
    assert classify(f"environment.variables.{name}") == NUMERICS
    assert classify(f"recipe.env.{name}") == NUMERICS
    doc = copy.deepcopy(B200)
    doc["environment"]["variables"][name] = "/elsewhere/src"
    report = diff_documents(B200, doc)
    assert report.exit_code == 2 and classes(report) == {f"environment.variables.{name}": NUMERICS}
