"""Every command is readable at 80 columns: help pages show each option's full name, and the
outputs wrap long values (hashes, paths, option names) instead of cutting them with an ellipsis.

The commands render in one child process started with COLUMNS=80, since rich sizes its consoles
from the environment when they are made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/fingerprints"
WIDTH = 80

_RENDER = r"""
import contextlib, io, json, os, sys
os.environ["COLUMNS"] = "80"
os.environ["TERM"] = "dumb"
from muse_stack.cli import app, main
import typer.main

def render(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as exc:
            rc = exc.code
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}

def walk(cmd, path):
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from walk(sub, path + [name])

helps, opts = {}, {}
for path, cmd in walk(typer.main.get_command(app), []):
    key = " ".join(path) or "(root)"
    helps[key] = render(path + ["--help"])
    opts[key] = sorted({o for p in cmd.params if not getattr(p, "hidden", False) for o in p.opts + p.secondary_opts})
outputs = {" ".join(a): render(a) for a in json.loads(sys.argv[1])}
print(json.dumps({"helps": helps, "opts": opts, "outputs": outputs}))
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("width")
    a = tmp / "a.json"
    b = tmp / "b.json"
    doc = json.loads((FIXTURES / "crafted-b200-attune.json").read_text())
    a.write_text(json.dumps(doc))
    doc["frameworks"]["transformer_engine"]["version"] = "2.18.0"
    doc["host"]["hostname"] = "p6-b200-node-042-with-a-rather-long-hostname-for-the-table"
    b.write_text(json.dumps(doc))
    runs = []
    for name, shift in (("golden-run-with-a-long-directory-name", 0.0), ("candidate", 0.5)):
        run = tmp / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "loss": 3.0 - 0.05 * i + (shift if i > 15 else 0.0), "grad_norm": 1.0,
                        "tokens_per_s_per_gpu": 500.0, "peak_memory_gib": 120.0}) + "\n" for i in range(1, 21)))
        (run / "results.json").write_text(json.dumps({"status": "completed", "steps_completed": 20, "window": [5, 20],
                                                      "tokens_per_s_per_gpu": 500.0, "peak_memory_gib": 120.0}))
        (run / "fingerprint.json").write_text((a if shift == 0 else b).read_text())
        runs.append(str(run))
    commands = [
        ["compare", *runs, "--no-plot"], ["compare", *runs, "--no-plot", "--preset", "bridge-pipeline"],
        ["list"], ["show", "sft-192", "--bridge"], ["plan", "sft-192"], ["plan", "attune-b200"],
        ["data", "show", "sft-192", "--cache", str(tmp / "cache")], ["data", "show", "tiny-cpu", "--cache", str(tmp / "cache")],
        ["stack", "show", "b200"], ["stack", "check", "b200"], ["stack", "build-args", "b200"],
        ["diff", str(a), str(b)], ["audit", str(b), "--recipe", "attune-b200"],
    ]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "HF_HOME": str(tmp / "hf"), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-c", _RENDER, json.dumps(commands)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line.rstrip()) > WIDTH]


def test_every_help_page_fits_and_names_every_option_in_full(rendered):
    assert len(rendered["helps"]) >= 20  # every command and group, not a sample
    for cmd, r in rendered["helps"].items():
        text = r["out"] + r["err"]
        assert r["rc"] == 0, (cmd, text)
        assert not _too_wide(text), (cmd, _too_wide(text))
        assert "…" not in text, (cmd, text)
        for opt in rendered["opts"][cmd]:
            assert opt in text, f"`{cmd} --help` does not show {opt} in full"


#: outputs read by programs, one KEY=VALUE a line (build-image.sh reads build-args): never wrapped
MACHINE_READABLE = {"stack build-args b200"}


def test_every_output_fits_and_cuts_nothing(rendered):
    for cmd, r in rendered["outputs"].items():
        text = r["out"] + r["err"]
        assert r["rc"] in (0, 1, 2), (cmd, text)  # diff/audit report differences with 1 or 2
        if cmd not in MACHINE_READABLE:
            assert not _too_wide(text), (cmd, _too_wide(text))
        assert "…" not in text, (cmd, text)


def test_list_shows_every_gpu_count_in_full(rendered):
    from muse_stack.recipes.catalogue import load_recipe, recipe_names

    out = rendered["outputs"]["list"]["out"]
    for name in recipe_names():
        row = next(line.split() for line in out.splitlines() if line.split()[:1] == [name])
        assert row[2] == str(load_recipe(name).hardware.count), row
