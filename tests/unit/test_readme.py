"""The README stays short and its map into docs/ points at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_is_short_and_names_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text


def test_every_relative_link_in_the_readme_and_docs_resolves():
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", md.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (md.parent / target).exists(), f"{md.relative_to(ROOT)} links to missing {target}"


def test_example_output_says_which_machine_it_came_from():
    text = (ROOT / "README.md").read_text()
    assert "same on every run" not in text.replace("\n", " ") or "On one machine" in text
    assert "2-core development machine" in text
