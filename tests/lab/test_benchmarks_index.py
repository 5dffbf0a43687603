"""benchmarks/index.yaml names every result folder under benchmarks/results/ with its command, machine and
what it measures, and every script under benchmarks/scripts/."""

from __future__ import annotations

from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
INDEX = yaml.safe_load((BENCH / "index.yaml").read_text())


def test_benchmarks_holds_two_rooms_and_the_index():
    assert {p.name for p in BENCH.iterdir() if not p.name.startswith(".")} == \
        {"README.md", "index.yaml", "results", "scripts"}


def test_every_result_folder_is_in_the_index():
    listed = {entry["path"] for entry in INDEX["results"]}
    folders = {f"results/{p.name}" for p in (BENCH / "results").iterdir() if p.is_dir()
               and not p.name.startswith((".", "__"))}
    assert folders - listed == set(), "result folders missing from benchmarks/index.yaml"
    assert listed - folders == set(), "index entries without a folder"
    assert len(listed) == len(INDEX["results"]), "a folder listed twice"


def test_every_entry_names_an_existing_command_a_machine_and_a_measure():
    for entry in INDEX["results"]:
        assert (BENCH / entry["command"]).is_file(), entry
        assert entry["machine"] and entry["measures"], entry


def test_scripts_holds_exactly_the_listed_scripts():
    listed = set(INDEX["scripts"])
    for script in listed:
        assert (BENCH / script).is_file(), f"{script}: listed under scripts: in benchmarks/index.yaml, not there"
        assert INDEX["scripts"][script], script
    present = {p.relative_to(BENCH).as_posix() for p in (BENCH / "scripts").rglob("*")
               if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts}
    assert present - listed == set(), "scripts missing from benchmarks/index.yaml's scripts:"
