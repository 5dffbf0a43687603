"""benchmarks/index.yaml names every result folder with its command, machine and what it measures."""

from __future__ import annotations

from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
INDEX = yaml.safe_load((BENCH / "index.yaml").read_text())


def test_every_result_folder_is_in_the_index():
    listed = {entry["path"] for entry in INDEX["results"]}
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders - listed == set(), "result folders missing from benchmarks/index.yaml"
    assert listed - folders == set(), "index entries without a folder"


def test_every_entry_names_an_existing_command_a_machine_and_a_measure():
    for entry in INDEX["results"]:
        assert (BENCH / entry["command"]).is_file(), entry
        assert entry["machine"] and entry["measures"], entry
    for script in INDEX["scripts"]:
        assert (BENCH / script).is_file(), script
