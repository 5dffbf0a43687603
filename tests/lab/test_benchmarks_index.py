"""benchmarks/ as data: every result folder has a valid result.json (benchmarks/schema.py) and is named in
benchmarks/index.yaml with its claim; every script is listed; every renamed folder is found under its new name; and
the schema catches each way a folder can go wrong."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
INDEX = yaml.safe_load((BENCH / "index.yaml").read_text())


def _schema():
    spec = importlib.util.spec_from_file_location("benchmarks_schema", BENCH / "schema.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


schema = _schema()


def test_benchmarks_holds_the_results_the_scripts_the_schema_and_the_index():
    assert {p.name for p in BENCH.iterdir() if not p.name.startswith((".", "__"))} == {
        "README.md",
        "index.yaml",
        "lab",
        "results",
        "schema.py",
        "scripts",
    }


def test_every_result_folder_is_in_the_index_and_only_those():
    listed = [entry["path"] for entry in INDEX["results"]]
    folders = {f"results/{p.relative_to(schema.RESULTS).as_posix()}" for p in schema.result_folders()}
    assert folders - set(listed) == set(), "result folders missing from benchmarks/index.yaml: render it"
    assert set(listed) - folders == set(), "index entries without a folder"
    assert len(listed) == len(set(listed)), "a folder listed twice"
    assert len(folders) >= 45


def test_every_result_folder_has_a_valid_result_file():
    problems = schema.check_all()
    assert problems == [], "\n".join(problems)


def test_each_index_entry_is_its_folders_result_file():
    """The index's list is rendered from the result files (render.py): each entry's claim and status are its
    folder's, so neither has a second owner."""
    for entry in INDEX["results"]:
        r = schema.load(BENCH / entry["path"])
        assert (entry["claim"], entry["status"], entry["date"], entry["hardware"]) == (
            r.claim,
            r.status,
            r.date,
            r.hardware,
        ), entry["path"]
        assert entry["command"] == r.commands[0]


def test_superseded_results_are_archived_and_point_at_a_current_one():
    entries = {e["path"]: e for e in INDEX["results"]}
    archived = {p for p in entries if p.startswith("results/archive/")}
    assert archived, "no result is archived"
    for path, entry in entries.items():
        assert (path in archived) is entry["status"].startswith("superseded-by "), path
    for path in archived:
        target = entries[path]["status"].split(" ", 1)[1]
        assert f"results/{target}" in entries, path


def test_renamed_folders_live_under_their_new_names():
    renamed = INDEX["renamed"]
    assert len(renamed) >= 11
    for old, new in renamed.items():
        assert not (BENCH / old).exists(), f"{old} was renamed to {new} but still exists"
        assert (BENCH / new).is_dir(), f"{old} was renamed to {new}, which does not exist"
    # no old name is left in the tree's docs, scripts and tests
    root = BENCH.parent
    docs = [
        *root.glob("*.md"),
        *(root / "docs").glob("*.md"),
        *(root / "tests").glob("*.py"),
        *BENCH.rglob("*.md"),
        *BENCH.rglob("*.sh"),
        *(BENCH / "scripts").rglob("*.py"),
    ]
    for old in renamed:
        name = old.removeprefix("results/")
        for doc in docs:
            text = doc.read_text()
            assert f"results/{name}/" not in text and f"`{name}/`" not in text, f"{doc} names {old}"


def test_scripts_holds_exactly_the_listed_scripts():
    listed = set(INDEX["scripts"])
    for script in listed:
        assert (BENCH / script).is_file(), f"{script}: listed under scripts: in benchmarks/index.yaml, not there"
        assert INDEX["scripts"][script], script
    present = {
        p.relative_to(BENCH).as_posix()
        for p in (BENCH / "scripts").rglob("*")
        if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
    }
    assert present - listed == set(), "scripts missing from benchmarks/index.yaml's scripts:"


def test_no_command_needs_a_file_outside_the_repository():
    """Every command runs from a clean checkout plus the GPU machine: the staging step is the repository's own
    (benchmarks/scripts/stage-gpu.sh), never a script beside the checkout."""
    root = BENCH.parent
    for path in [*BENCH.rglob("*"), *root.glob("*.md"), *(root / "docs").glob("*.md"), *(root / "tests").rglob("*.md")]:
        if path.is_file() and path.suffix in (".sh", ".md", ".py", ".yaml", ".txt"):
            text = path.read_text(errors="replace")
            assert "shared/device/" not in text and "te-stage.sh" not in text, path


# ---- the schema catches each way a folder goes wrong ----------------------------------------------------------------


def _good(tmp_path: Path) -> Path:
    """A results tree holding one valid folder."""
    folder = tmp_path / "results" / "demo-run"
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(
        json.dumps(
            {
                "tokens_per_s_per_gpu": 100.0,
                "mfu": 0.5,
                "status": "completed",
                "steps_completed": 30,
                "warmup_steps": 10,
                "window": [11, 30],
            }
        )
    )
    (folder / "fingerprint.json").write_text(
        json.dumps(
            {"capture": {"captured_at": "2026-12-01T10:00:00+00:00"}, "gpu": {"names": ["NVIDIA H200"], "count": 1}}
        )
    )
    (folder / "result.json").write_text(
        json.dumps(
            {
                "schema": schema.SCHEMA,
                "id": "demo-run",
                "claim": "A demo run trains at the speed its results state.",
                "status": "current",
                "date": "2026-12-01",
                "hardware": "1 x NVIDIA H200",
                "fingerprint": "fingerprint.json",
                "commands": ["python benchmarks/schema.py"],
                "method": {
                    "steps": 30,
                    "warmup_steps": 10,
                    "window": "steps 11-30",
                    "repeats": "one run",
                    "how": "a demo",
                },
                "measured": [
                    {"name": "tokens_per_s_per_gpu", "unit": "tokens/s", "source": "results.json#/tokens_per_s_per_gpu"}
                ],
                "figures": {"results.json": "the run's results"},
            }
        )
    )
    return tmp_path / "results"


def _edit(results: Path, **changes) -> None:
    path = results / "demo-run" / "result.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_a_valid_folder_has_no_problems(tmp_path):
    assert schema.check_all(_good(tmp_path)) == []


@pytest.mark.parametrize(
    "change, words",
    [
        ({"claim": "Two sentences. Not one."}, "one sentence"),
        ({"status": "old"}, "status"),
        ({"id": "other"}, "is not the folder's path"),
        ({"date": "2026-11-30"}, "fingerprints were captured 2026-12-01"),
        ({"hardware": "1 x NVIDIA H100"}, "does not name NVIDIA H200"),
        ({"fingerprint": "fp.json"}, "matches no file"),
        ({"commands": ["python benchmarks/no-such-script.py"]}, "not in the repository"),
        ({"measured": [{"name": "x", "unit": "s", "source": "results.json#/step_s"}]}, "has no /step_s"),
        ({"figures": {"results.json": "r", "profile.json": "p"}}, "matches no file"),
        ({"figures": {"fingerprint.json": "the fingerprint"}}, "results.json is not described"),
        ({"status": "superseded-by demo-run"}, "under results/archive/"),
        ({"runs": {"run1": "a run"}}, "not a folder here"),
        ({"extra": 1}, "extra"),
        (
            {"method": {"steps": 20, "warmup_steps": 10, "window": "steps 11-30", "repeats": "one", "how": "h"}},
            "results.json records 30",
        ),
        (
            {"method": {"steps": 30, "warmup_steps": 10, "window": "steps 9-20", "repeats": "one", "how": "h"}},
            "is not results.json's steps",
        ),
    ],
)
def test_a_broken_folder_is_named_with_its_field(tmp_path, change, words):
    results = _good(tmp_path)
    _edit(results, **change)
    found = schema.check_all(results)
    assert found and any(words in p for p in found), found
    assert all("results/demo-run/result.json" in p for p in found), found


def test_an_undescribed_run_folder_and_a_missing_result_file_are_named(tmp_path):
    results = _good(tmp_path)
    (results / "demo-run" / "run1").mkdir()
    assert any("run1/ is not described" in p for p in schema.check_all(results))
    shutil.rmtree(results / "demo-run" / "run1")
    (results / "bare").mkdir()
    assert any("bare/result.json: missing" in p for p in schema.check_all(results))


def test_an_archived_result_must_say_what_superseded_it(tmp_path):
    results = _good(tmp_path)
    (results / "archive").mkdir()
    shutil.copytree(results / "demo-run", results / "archive" / "old-run")
    doc = json.loads((results / "archive" / "old-run" / "result.json").read_text())
    doc.update(id="archive/old-run")
    (results / "archive" / "old-run" / "result.json").write_text(json.dumps(doc))
    assert any("only it" in p for p in schema.check_all(results))  # archived but "current"
    doc.update(status="superseded-by nothing-here")
    (results / "archive" / "old-run" / "result.json").write_text(json.dumps(doc))
    assert any("not another result folder" in p for p in schema.check_all(results))
    doc.update(status="superseded-by demo-run")
    (results / "archive" / "old-run" / "result.json").write_text(json.dumps(doc))
    assert schema.check_all(results) == []
